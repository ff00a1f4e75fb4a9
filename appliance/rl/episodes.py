"""An agent's episode on a repository task (finetune.rl.environment runs it): every turn's tool
calls with what each observed, the reward and why the episode ended, and the digest of the
workspace it left, which a replay of the same calls must reach again. Kept in the artifact store
under its own SHA-256 (episodes/<sha256>.json, never written again) and named in a local index."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from appliance.artifacts import ArtifactStore
from appliance.errors import IntegrityError, Invalid, NotFound
from appliance.home import Home
from appliance.registry import JsonRegistry
from appliance.terminal import shown

MAX_ARGUMENTS = 65536  # of one call's arguments' text: more is refused, not run
# What a step-by-step view shows of each text, in characters.
SHOWN_CONTENT, SHOWN_ARGUMENTS, SHOWN_OUTPUT = 500, 300, 800
Ended = Literal["submitted", "answered", "steps", "tool_calls", "tokens", "wall_time", "contained", "refused"]


class ToolStep(BaseModel):
    """One tool call and what it observed."""

    model_config = ConfigDict(extra="forbid")

    call_id: str = Field(max_length=200)
    name: str = Field(max_length=200)
    arguments: str = Field(max_length=MAX_ARGUMENTS, description="As the model wrote them (JSON text).")
    output: str
    ok: bool  # the tool did its work (not refused, not failed)
    seconds: float


class Turn(BaseModel):
    """One answer of the model and the tool calls it made."""

    model_config = ConfigDict(extra="forbid")

    request_id: str | None = Field(None, max_length=200, description="The gateway's, for its audit record.")
    content: str
    completion_tokens: int
    generation_s: float = 0.0  # the gateway's answer, as the driver waited for it
    tools: list[ToolStep]
    refused: str | None = None  # the gateway refused this answer (its call failed the schema, say): why


class Episode(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task: str
    task_set: str | None = None  # the stored set the task came from, if it did
    model: str
    turns: list[Turn]
    ended: Ended
    reason: str  # in words: which budget, what was contained, what the tests said
    reward: float  # the share of the task's tests the final workspace passes; 0 when contained
    tests_passed: int
    tests_total: int
    workspace_sha256: str | None  # of the final workspace's files; None when it was lost
    seconds: float
    reset_s: float = 0.0  # the sandbox started and the task's files put in
    # What the model was shown first (episodes kept before these were recorded have neither).
    system: str | None = None
    opening: str | None = None  # the environment's first observation

    @property
    def tool_calls(self) -> int:
        return sum(len(turn.tools) for turn in self.turns)

    @property
    def passed(self) -> bool:
        """Submitted with every test of the task passing: an episode to learn from."""
        return self.ended == "submitted" and 0 < self.tests_passed == self.tests_total

    def messages(self) -> list[dict[str, Any]]:
        """The conversation the model was shown and answered, whole."""
        if self.system is None or self.opening is None:
            raise Invalid(f"the episode of {self.task} was kept before episodes recorded what the model was "
                          "shown first: run it again")
        return conversation(self.system, self.opening, self.turns)


def conversation(system: str, opening: str, turns: list[Turn]) -> list[dict[str, Any]]:
    """The chat after `turns`: the system prompt and the first observation, then each answer (its
    text and the calls that ran) and each call's output as a `tool` message; an answer the gateway
    refused is the refusal said back as a user turn. The driver asks with it at every turn, and
    training rows are made from it, so both are the same conversation."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}, {"role": "user", "content": opening}]
    for turn in turns:
        if turn.refused is not None:
            messages.append({"role": "user", "content": f"The gateway refused your last answer: "
                                                        f"{turn.refused[:500]}. Call a tool with arguments that "
                                                        "match its schema."})
            continue
        calls = [{"id": step.call_id, "type": "function", "function": {"name": step.name, "arguments": step.arguments}}
                 for step in turn.tools]
        messages.append({"role": "assistant", "content": turn.content or None, "tool_calls": calls} if calls
                        else {"role": "assistant", "content": turn.content})
        messages += [{"role": "tool", "tool_call_id": step.call_id, "content": step.output} for step in turn.tools]
    return messages


PREFIX = "episodes/"


class EpisodeEntry(BaseModel):
    """An episode kept: its id (its SHA-256's first 16 hex digits), where it is, what it came to."""

    id: str
    sha256: str
    key: str
    task: str
    task_set: str | None
    model: str
    ended: Ended
    reward: float
    answers: int
    tool_calls: int
    failed_calls: dict[str, int]  # tool name: calls that did not do their work
    seconds: float
    created: str


def episode_registry(home: Home) -> JsonRegistry[dict[str, EpisodeEntry]]:
    return JsonRegistry(home.root / "episodes.json", dict[str, EpisodeEntry], "the episode index")


def keep(episode: Episode, artifacts: ArtifactStore, home: Home) -> EpisodeEntry:
    """Put the episode in the artifact store under its SHA-256 and name it in the index."""
    data = episode.model_dump_json(indent=1).encode()
    digest = hashlib.sha256(data).hexdigest()
    key = f"{PREFIX}{digest}.json"
    artifacts.put(key, data, retain_days=0)
    failed: dict[str, int] = {}
    for turn in episode.turns:
        for step in turn.tools:
            if not step.ok:
                failed[step.name] = failed.get(step.name, 0) + 1
    entry = EpisodeEntry(id=digest[:16], sha256=digest, key=key, task=episode.task, task_set=episode.task_set,
                         model=episode.model, ended=episode.ended, reward=episode.reward, answers=len(episode.turns),
                         tool_calls=episode.tool_calls, failed_calls=failed, seconds=episode.seconds,
                         created=datetime.now(UTC).isoformat(timespec="seconds"))
    with episode_registry(home).change() as registry:
        registry[entry.id] = entry
    return entry


def read(episode_id: str, artifacts: ArtifactStore, home: Home) -> Episode:
    """A kept episode, checked against the digest its index recorded."""
    index = episode_registry(home).read()
    if episode_id not in index:
        raise NotFound(f"no episode {episode_id[:40]!r}", hint="`appliance rl episodes list`")
    entry = index[episode_id]
    data = artifacts.get(entry.key)
    if hashlib.sha256(data).hexdigest() != entry.sha256:
        raise IntegrityError(f"episode {episode_id}: its record in the artifact store was changed since it was kept")
    try:
        return Episode.model_validate_json(data)
    except ValidationError as exc:
        raise IntegrityError(f"episode {episode_id}: its record is not an episode: {exc.errors()[0]['msg']}") from exc


# -- an episode as text, for the CLI and the TUI ---------------------------------------------


def step_lines(episode: Episode) -> list[str]:
    """An episode step by step: how it ended, then each answer, its tool calls with their
    arguments and what each observed (clipped). Safe on a terminal and never markup to print;
    text from the model or a tool starts no line of its own at the indentation of an answer or a
    call (its further lines are indented deeper), so it cannot pass for one."""
    lines = [f"task {one_line(episode.task)}, model {one_line(episode.model)}: ended {episode.ended} "
             f"({one_line(episode.reason)}); reward {episode.reward:g}, {episode.tests_passed}/"
             f"{episode.tests_total} tests"]
    for number, turn in enumerate(episode.turns, 1):
        request = f", request {one_line(turn.request_id)}" if turn.request_id else ""
        lines.append(f"answer {number} ({turn.completion_tokens} tokens, {turn.generation_s:.1f} s{request})")
        if turn.refused:
            lines += block("  refused by the gateway: ", turn.refused, SHOWN_CONTENT)
        if turn.content:
            lines += block("  said: ", turn.content, SHOWN_CONTENT)
        for step in turn.tools:
            lines += block(f"  {'ok' if step.ok else 'failed'} {one_line(step.name)} ", step.arguments,
                           SHOWN_ARGUMENTS)
            lines += [f"    {line}" for line in clipped(step.output, SHOWN_OUTPUT).splitlines()]
    return lines


def failures_text(failed_calls: dict[str, int]) -> str:
    """Calls that did not do their work, by tool: "read_file 1, shell 2", or "none"."""
    return ", ".join(f"{one_line(name)} {count}" for name, count in sorted(failed_calls.items())) or "none"


def block(head: str, text: str, limit: int) -> list[str]:
    """`head` and the first line of `text` (clipped to `limit`), its other lines indented below."""
    first, *rest = clipped(text, limit).split("\n")
    return [head + first, *(f"      {line}" for line in rest)]


def clipped(text: str, limit: int) -> str:
    """At most `limit` characters of `text`, safe on a terminal; an ellipsis says where it was cut."""
    return shown(text if len(text) <= limit else text[:limit] + "…").plain


def one_line(text: str) -> str:
    """A name or a reason on one line: its line breaks written as \\n."""
    return shown(text.replace("\n", "\\n")).plain
