"""`appliance rl episodes run`: one agent episode on a repository task through the gateway (the model
as the RL service identity, its tools in the episode's sandbox), its record written to a file;
`appliance rl episodes replay`: the recorded calls again in a fresh sandbox, to the same final
workspace; `appliance rl episodes export`: the episodes that passed as training rows (chats that
offer the environment's tools) for `data add`."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import typer
from pydantic import BaseModel, ValidationError
from rich.console import Console

from appliance.artifacts import artifact_store
from appliance.commands.common import AsJson
from appliance.errors import Invalid
from appliance.home import Home
from appliance.rl import episodes
from appliance.rl.episodes import Episode
from appliance.rl.tasks import RepositoryTask
from appliance.settings import load_settings
from appliance.terminal import Listing, shown, text
from finetune.rl.agent import run_episode
from finetune.rl.environment import TOOL_SCHEMAS, WorkspaceEnvironment
from finetune.rl.loop import Generator
from finetune.rl.tasks import load_repository

out = Console()
M = TypeVar("M", bound=BaseModel)
MAX_FILE_BYTES = 32 << 20


def read_model(path: Path, model: type[M], what: str) -> M:
    """`path` as a `model` (JSON), or Invalid naming the file and where in it it is wrong."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(descriptor, "rb") as handle:
            if not stat.S_ISREG(os.fstat(descriptor).st_mode):
                raise Invalid(f"{what} {path}: not a regular file")
            data = handle.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise Invalid(f"{what} {path}: larger than {MAX_FILE_BYTES:,} bytes")
        return model.model_validate(json.loads(data.decode("utf-8")))
    except OSError as exc:
        raise Invalid(f"{what} {path}: cannot read it: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise Invalid(f"{what} {path}: not UTF-8 text (byte {exc.start})") from exc
    except json.JSONDecodeError as exc:
        raise Invalid(f"{what} {path}:{exc.lineno}:{exc.colno}: not JSON: {exc.msg}") from exc
    except ValidationError as exc:
        first = exc.errors()[0]
        raise Invalid(f"{what} {path}: [{'.'.join(map(str, first['loc'])) or 'top'}]: {first['msg']}") from exc


def chosen_task(task: Path | None, task_set: str | None, task_id: str | None) -> RepositoryTask:
    """The task a command names: a JSON file, or a task of a stored set of repository tasks."""
    if (task is None) == (task_set is None):
        raise Invalid("name the task: --task FILE, or --task-set NAME with --task-id ID")
    if task is not None:
        return read_model(task, RepositoryTask, "--task")
    assert task_set is not None
    home = Home.from_env()
    found = load_repository(task_set, "all", artifact_store(load_settings(home.settings_file).artifacts, home), home)
    if task_id is None:
        raise Invalid(f"--task-set {task_set}: which task (--task-id)? the first: "
                      f"{', '.join(t.id for t in found[:5])}")
    for each in found:
        if each.id == task_id:
            return each
    raise Invalid(f"--task-id {task_id[:200]!r}: not in task set {task_set!r}")


def answer_options(tool_choice: str, extra_body: str | None) -> tuple[Literal["auto", "required"],
                                                                       dict[str, Any] | None]:
    """--tool-choice and --extra-body, checked."""
    if tool_choice not in ("auto", "required"):
        raise Invalid(f"--tool-choice {tool_choice!r}: auto or required")
    try:
        extra = None if extra_body is None else json.loads(extra_body)
    except json.JSONDecodeError as exc:
        raise Invalid(f"--extra-body: not JSON at character {exc.pos}: {exc.msg}") from exc
    except RecursionError as exc:
        raise Invalid("--extra-body: nested too deep") from exc
    if extra is not None and not isinstance(extra, dict):
        raise Invalid("--extra-body: a JSON object of request fields")
    return ("required" if tool_choice == "required" else "auto"), extra


def episode_command(
    model: Annotated[str, typer.Option(help="The served model (a pool's model or a deployed adapter).")],
    out_file: Annotated[Path | None, typer.Option("--out", help="A copy of the episode's record (JSON).")] = None,
    task: Annotated[Path | None, typer.Option(help="A repository task (JSON: id, instruction, files, tests).")] = None,
    task_set: Annotated[str | None, typer.Option(help="A stored set of repository tasks (rl tasks make).")] = None,
    task_id: Annotated[str | None, typer.Option(help="The task of --task-set.")] = None,
    tool_choice: Annotated[str, typer.Option(help="auto, or required (a tool call every answer).")] = "auto",
    temperature: Annotated[float, typer.Option(help="Sampling temperature (0: greedy).")] = 0.0,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    extra_body: Annotated[str | None, typer.Option(help="A JSON object of request fields added to every answer "
                                                        "(vLLM's sampling or structured_outputs fields).")] = None,
    as_json: AsJson = False,
) -> None:
    """Run one agent episode on a repository task through the gateway; exit 0 if the task's tests
    all pass."""
    choice, extra = answer_options(tool_choice, extra_body)
    repository = chosen_task(task, task_set, task_id)
    home = Home.from_env()
    settings = load_settings(home.settings_file)
    generator = Generator(settings, home, model)
    try:
        with WorkspaceEnvironment(repository, settings.execution, settings.rl) as environment:
            episode = run_episode(repository, generator, environment, settings.rl, temperature=temperature,
                                  seed=seed, tool_choice=choice, extra_body=extra)
    finally:
        generator.close()
    episode = episode.model_copy(update={"task_set": task_set})
    entry = episodes.keep(episode, artifact_store(settings.artifacts, home), home)
    if out_file is not None:
        out_file.write_text(episode.model_dump_json(indent=1))
    if as_json:
        print(json.dumps({"id": entry.id, **episode.model_dump(mode="json")}))
    else:
        out.print(f"episode {entry.id} of {episode.task}: {len(episode.turns)} answers, {episode.tool_calls} tool "
                  f"calls; ended: {episode.ended} ({episode.reason}); reward {episode.reward:g} "
                  f"({episode.tests_passed}/{episode.tests_total} tests); {episode.seconds:.1f} s", highlight=False)
    if episode.reward < 1:
        raise typer.Exit(1)


def _episode(which: str) -> Episode:
    """A kept episode by its id, or a record's file (`run --out`)."""
    if Path(which).is_file():
        return read_model(Path(which), Episode, "episode")
    home = Home.from_env()
    return episodes.read(which, artifact_store(load_settings(home.settings_file).artifacts, home), home)


def list_command(as_json: AsJson = False) -> None:
    """The episodes kept, oldest first: how each ended, its reward, its calls and which tools failed."""
    found = list(episodes.episode_registry(Home.from_env()).read().values())
    if as_json:
        typer.echo(json.dumps([entry.model_dump() for entry in found], indent=1))
        return
    table = Listing("id", "task", "model", "ended", "reward", "answers", "calls", text("failed calls"), "added")
    for entry in found:
        table.add_row(entry.id, shown(entry.task), shown(entry.model), entry.ended, f"{entry.reward:g}",
                      str(entry.answers), str(entry.tool_calls), shown(episodes.failures_text(entry.failed_calls)),
                      entry.created)
    out.print(table, crop=False)


def show_command(
    episode: Annotated[str, typer.Argument(help="An episode's id (`rl episodes list`), or a record's file.")],
    as_json: AsJson = False,
) -> None:
    """An episode step by step: each answer, its tool calls with their arguments, and what each observed."""
    found = _episode(episode)
    if as_json:
        typer.echo(found.model_dump_json(indent=1))
        return
    for line in episodes.step_lines(found):
        out.print(line, markup=False, highlight=False)  # the model's text is shown, never read as markup


def export_command(
    out_file: Annotated[Path, typer.Option("--out", help="The JSON-lines file to write (made new, mode 0600).")],
    model: Annotated[str | None, typer.Option(help="Only the episodes of this model.")] = None,
    task_set: Annotated[str | None, typer.Option(help="Only the episodes of this stored task set.")] = None,
) -> None:
    """Write the kept episodes that passed (submitted, every test passing) as chat rows that offer
    the environment's tools: each answer's text and calls to learn, the tools' outputs as context
    (`appliance data add FILE` imports them; a job trains on every answer of such a row)."""
    home = Home.from_env()
    artifacts = artifact_store(load_settings(home.settings_file).artifacts, home)
    chosen = [entry for entry in episodes.episode_registry(home).read().values()
              if (model is None or entry.model == model) and (task_set is None or entry.task_set == task_set)]
    rows = []
    for entry in chosen:
        episode = episodes.read(entry.id, artifacts, home)
        if episode.passed:
            rows.append(json.dumps({"messages": episode.messages(), "tools": TOOL_SCHEMAS}, ensure_ascii=False))
    if not rows:
        raise Invalid(f"none of the {len(chosen)} episodes chosen passed: nothing to export",
                      hint="`appliance rl episodes list` shows how each ended")
    try:
        descriptor = os.open(out_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise Invalid(f"--out {out_file}: cannot make it: {exc.strerror or exc}",
                      hint="name a file that does not exist yet") from exc
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write("".join(row + "\n" for row in rows))
    out.print(f"{len(rows)} of {len(chosen)} episodes passed, written to {out_file}", highlight=False)


def replay_command(
    episode_ref: Annotated[str, typer.Argument(metavar="EPISODE", help="An episode's id, or a record's file.")],
    task: Annotated[Path | None, typer.Option(help="The repository task it ran on (JSON), if it came from no "
                                                   "stored set.")] = None,
    task_set: Annotated[str | None, typer.Option(help="The stored set it is in (the episode's own, unless "
                                                      "given).")] = None,
) -> None:
    """Run an episode's recorded tool calls again in a fresh sandbox; exit 0 if they leave the
    workspace the episode left (the same digest), 1 if not."""
    episode = _episode(episode_ref)
    task_set = task_set or (episode.task_set if task is None else None)
    repository = chosen_task(task, task_set, episode.task if task_set else None)
    if repository.id != episode.task:
        raise Invalid(f"--task {task}: task {repository.id!r}, but the episode ran on {episode.task!r}")
    settings = load_settings(Home.from_env().settings_file)
    with WorkspaceEnvironment(repository, settings.execution, settings.rl) as environment:
        replayed = environment.replay([step for turn in episode.turns for step in turn.tools])
    same = replayed.workspace_sha256 == episode.workspace_sha256
    out.print(f"replayed {episode.tool_calls} tool calls: workspace {replayed.workspace_sha256 or 'lost'} "
              f"{'matches' if same else 'differs from'} the episode's ({episode.workspace_sha256 or 'lost'}); "
              f"reward {replayed.reward:g} (recorded {episode.reward:g})", highlight=False)
    if not same:
        raise typer.Exit(1)
