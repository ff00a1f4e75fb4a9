"""Multi-turn environments: an agent works on a repository task through tools, in one sandbox for
the whole episode (finetune.rl.execute.Sandbox with a workspace), and is rewarded by the task's
tests.

The protocol is Gym's, as verifiers' MultiTurnEnv and OpenEnv have it: `reset()` gives the first
observation; `step(calls, completion_tokens)` runs the model's tool calls of one answer and gives
what each observed, whether the episode is done and, when it is, the reward; `close()` throws the
workspace away. It is our own rather than verifiers' because verifiers drives the model itself
through an OpenAI client: here the model is reached only through the gateway, under the RL service
identity (finetune.rl.agent), and the environment only acts.

Tools (OpenAI function schemas, TOOL_SCHEMAS): list_files, read_file, write_file and search act on
the workspace (finetune/rl/workspace_tools.py, in the sandbox); run_tests runs its test functions;
shell runs a command (/bin/sh) in it, with the sandbox's time, output and process limits; submit
ends the episode. Each call is its own execution in the episode's sandbox (no process outlives
it), as a user id drawn for the episode; only the workspace, a tmpfs of `rl.workspace_mib`, is
kept between them. An execution that goes over a limit kills the sandbox and its workspace: the
episode ends, contained, with no reward.

Budgets (rl.episode_*): answers, tool calls (calls past it are not run), completion tokens and
wall time. At the end the task's test files are restored over the workspace's and run: the
reward is the share that pass.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from appliance.errors import Invalid
from appliance.rl.episodes import MAX_ARGUMENTS, Ended, ToolStep
from appliance.rl.tasks import RepositoryTask
from appliance.settings import ExecutionSettings, RlSettings
from finetune.rl.execute import Sandbox, Verdict
from finetune.sandbox import SandboxError

PATH = Field(".", min_length=1, max_length=4096)
WRITE_BYTES = 32_768  # what one write_file call carries (the sandbox takes a request of 64 KiB)


class _Arguments(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ListFiles(_Arguments):
    """List the files and directories under a path of the workspace."""

    path: str = PATH


class ReadFile(_Arguments):
    """Read a text file of the workspace, its lines numbered (all, or from start_line to end_line)."""

    path: str = Field(min_length=1, max_length=4096)
    start_line: int = Field(1, ge=1)
    end_line: int | None = Field(None, ge=1)


class WriteFile(_Arguments):
    """Write a text file of the workspace (made, or replaced whole)."""

    path: str = Field(min_length=1, max_length=4096)
    content: str = Field(max_length=WRITE_BYTES)


class Search(_Arguments):
    """Find the lines holding a text in the workspace's files (under a path)."""

    text: str = Field(min_length=1, max_length=200)
    path: str = PATH


class RunTests(_Arguments):
    """Run the workspace's tests (test_* functions in test_*.py files) and see which fail."""


class Shell(_Arguments):
    """Run a shell command in the workspace (no network; time, output and processes limited)."""

    command: str = Field(min_length=1, max_length=4096)


class Submit(_Arguments):
    """Finish: the task's tests decide the reward."""


TOOLS: dict[str, type[_Arguments]] = {"list_files": ListFiles, "read_file": ReadFile, "write_file": WriteFile,
                                      "search": Search, "run_tests": RunTests, "shell": Shell, "submit": Submit}
FILE_TOOLS = ("list_files", "read_file", "write_file", "search")


def _schema(model: type[_Arguments]) -> dict[str, Any]:
    schema = model.model_json_schema()
    schema.pop("title", None)
    schema.pop("description", None)
    for value in schema.get("properties", {}).values():
        value.pop("title", None)
    return schema


TOOL_SCHEMAS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": name, "description": (model.__doc__ or "").strip(),
                                      "parameters": _schema(model)}} for name, model in TOOLS.items()]


@dataclass(frozen=True)
class Call:
    """One tool call of the model's, as the gateway passed it: `arguments` as the model wrote them
    (JSON text)."""

    id: str
    name: str
    arguments: str


@dataclass
class StepResult:
    tools: list[ToolStep]
    done: bool
    ended: Ended | None = None
    reason: str = ""
    reward: float = 0.0
    tests_passed: int = 0
    tests_total: int = 0
    workspace_sha256: str | None = None


@dataclass
class _Spent:
    steps: int = 0
    tool_calls: int = 0
    tokens: int = 0
    started: float = field(default_factory=time.monotonic)


class WorkspaceEnvironment:
    """One episode of `task`: reset, step until done, close (a context manager closes it)."""

    def __init__(self, task: RepositoryTask, execution: ExecutionSettings, rl: RlSettings) -> None:
        self.task, self.rl = task, rl
        self.sandbox = Sandbox(execution, workspace_mib=rl.workspace_mib)
        self.spent = _Spent()
        self.done = False

    def __enter__(self) -> WorkspaceEnvironment:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """The sandbox ends, and its workspace with it."""
        self.sandbox.close()

    def reset(self) -> str:
        """The task's files in a fresh workspace; the first observation: the instruction and them."""
        self.sandbox.close()
        self.sandbox.lost, self.spent, self.done = False, _Spent(), False
        seeded = self.sandbox.act("seed", files=self.task.files)
        if seeded.status != "passed":
            raise SandboxError(f"the task's files could not be put in the workspace: {seeded.reason}")
        listing = "\n".join(sorted(self.task.files))
        return f"{self.task.instruction}\n\nThe workspace holds:\n{listing}"

    def step(self, calls: list[Call], completion_tokens: int, *, refused: bool = False) -> StepResult:
        """One answer of the model's: its tool calls run in turn, until one ends the episode.
        `refused`: the gateway refused the answer (a call failing its schema): it counts, and the
        episode goes on while the budgets last."""
        if self.done:
            raise SandboxError("the episode is over: reset it first")
        spent, rl = self.spent, self.rl
        spent.steps += 1
        spent.tokens += completion_tokens
        tools: list[ToolStep] = []
        ended: tuple[Ended, str] | None = None
        if not calls and not refused:
            ended = ("answered", "the model answered without a tool call")
        for call in calls:
            if spent.tool_calls >= rl.episode_tool_calls:
                ended = ("tool_calls", f"the budget of {rl.episode_tool_calls} tool calls was spent; "
                                       f"{len(calls) - len(tools)} calls of the last answer were not run")
                break
            if time.monotonic() - spent.started > rl.episode_wall_s:
                ended = ("wall_time", f"the episode's {rl.episode_wall_s:g} s were spent")
                break
            spent.tool_calls += 1
            step = self._run(call)
            tools.append(step)
            if self.sandbox.lost:
                ended = ("contained", f"{call.name} went over a sandbox limit: {step.output[:300]}")
                break
            if call.name == "submit" and step.ok:
                ended = ("submitted", "the model submitted")
                break
        if ended is None and time.monotonic() - spent.started > rl.episode_wall_s:  # spent waiting for answers
            ended = ("wall_time", f"the episode's {rl.episode_wall_s:g} s were spent")
        if ended is None and spent.tokens >= rl.episode_tokens:
            ended = ("tokens", f"the budget of {rl.episode_tokens} completion tokens was spent")
        if ended is None and spent.steps >= rl.episode_steps:
            ended = ("steps", f"the budget of {rl.episode_steps} answers was spent")
        if ended is None:
            return StepResult(tools=tools, done=False)
        return self.finish(tools, *ended)

    def finish(self, tools: list[ToolStep], ended: Ended, reason: str) -> StepResult:
        """The end: the task's tests restored and run on the workspace (no reward when contained)."""
        self.done = True
        if self.sandbox.lost or ended == "contained":
            return StepResult(tools=tools, done=True, ended="contained", reason=reason)
        try:
            checked = self.sandbox.act("check", files=self.task.test_files())
            if self.sandbox.lost:
                return StepResult(tools=tools, done=True, ended="contained",
                                  reason=f"the task's tests went over a sandbox limit: {checked.reason}")
            workspace = self.workspace_sha256()
        except SandboxError as exc:
            return StepResult(tools=tools, done=True, ended="contained", reason=str(exc))
        total = checked.tests_total
        return StepResult(tools=tools, done=True, ended=ended, reason=f"{reason}; tests: {checked.reason}",
                          reward=round(checked.tests_passed / total, 4) if total else 0.0,
                          tests_passed=checked.tests_passed, tests_total=total, workspace_sha256=workspace)

    def workspace_sha256(self) -> str:
        found = self.sandbox.act("tool", environment={"TOOL": json.dumps({"name": "digest", "arguments": {}})})
        if found.status != "passed":
            raise SandboxError(f"the workspace's digest: {found.reason}")
        return found.stdout.strip()

    def replay(self, tools: list[ToolStep]) -> StepResult:
        """The recorded calls of an episode again, in order, in a fresh workspace, then its end:
        the same calls must leave the same workspace."""
        self.reset()
        for step in tools:
            self._run(Call(step.call_id, step.name, step.arguments))
            if self.sandbox.lost:
                return self.finish([], "contained", f"{step.name} went over a sandbox limit")
        return self.finish([], "submitted", "replayed")

    def _run(self, call: Call) -> ToolStep:
        started = time.monotonic()
        ok, output = self._act(call)
        return ToolStep(call_id=call.id[:200], name=call.name[:200], arguments=call.arguments[:MAX_ARGUMENTS],
                        output=_trimmed(output, self.rl.observation_bytes), ok=ok,
                        seconds=round(time.monotonic() - started, 3))

    def _act(self, call: Call) -> tuple[bool, str]:
        """Whether the call did its work, and what it printed."""
        model = TOOLS.get(call.name)
        if model is None:
            return False, f"refused: no tool {call.name[:100]!r}; the tools: {', '.join(TOOLS)}"
        if len(call.arguments) > MAX_ARGUMENTS:
            return False, f"refused: {call.name}'s arguments are over {MAX_ARGUMENTS:,} characters"
        try:
            arguments = model.model_validate(json.loads(call.arguments or "{}")).model_dump(exclude_none=True)
        except (ValueError, ValidationError, RecursionError) as exc:  # RecursionError: JSON nested too deep
            return False, f"refused: {call.name}'s arguments: {_said(exc)}"
        try:
            if call.name in FILE_TOOLS:
                verdict = self.sandbox.act("tool", environment={"TOOL": json.dumps(
                    {"name": call.name, "arguments": arguments})})
                return verdict.status == "passed", _printed(verdict)
            if call.name == "shell":
                verdict = self.sandbox.act("shell", environment={"COMMAND": arguments["command"]})
                return verdict.status == "passed", f"{_printed(verdict)}\n[{verdict.reason}]"
            if call.name == "run_tests":
                return True, _tests(self.sandbox.act("tests"))
        except Invalid as exc:  # a request past what the sandbox takes (a write of escaped text, say)
            return False, f"refused: {exc.message}"
        except SandboxError as exc:
            return False, f"the sandbox failed: {exc.message}"
        return True, "submitted"  # submit


def _printed(verdict: Verdict) -> str:
    if verdict.reason.startswith(("wall time", "stdout over", "stderr over")):
        return f"stopped: {verdict.reason}"
    return verdict.stdout + (("\n" + verdict.stderr) if verdict.stderr else "")


def _tests(verdict: Verdict) -> str:
    if not verdict.tests_total:
        return f"no test ran: {verdict.reason}"
    failing = [f"FAILED {t.test}: {t.reason}" for t in verdict.tests if not t.passed]
    return "\n".join([f"{verdict.tests_passed} of {verdict.tests_total} tests passed", *failing[:20]])


def _said(exc: ValueError | ValidationError | RecursionError) -> str:
    if isinstance(exc, RecursionError):
        return "nested too deep"
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}" for e in exc.errors()[:5])
    return "not a JSON object" if isinstance(exc, json.JSONDecodeError) else str(exc)[:200]


def _trimmed(text: str, limit: int) -> str:
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return text
    half = limit // 2
    return (f"{data[:half].decode('utf-8', 'ignore')}\n... [{len(data) - limit:,} bytes left out] ...\n"
            f"{data[-half:].decode('utf-8', 'ignore')}")
