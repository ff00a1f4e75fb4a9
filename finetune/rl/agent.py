"""An agent's episode driven through the gateway: the model, as the RL service identity (so every
answer is authenticated, limited, screened and audited like any client's), is offered the
environment's tools (finetune.rl.environment.TOOL_SCHEMAS); each tool call the gateway passes
(checked against its schema there) runs in the episode's sandbox and its output goes back as a
`tool` message, until the environment says the episode is done."""

from __future__ import annotations

import time
from typing import Any, Literal

import httpx

from appliance.errors import Invalid, Unavailable
from appliance.rl.episodes import Episode, Turn, conversation
from appliance.rl.tasks import RepositoryTask
from appliance.settings import RlSettings
from finetune.rl.environment import TOOL_SCHEMAS, Call, StepResult, WorkspaceEnvironment
from finetune.rl.loop import Generator, Refused

ToolChoice = Literal["auto", "required"]
SYSTEM = ("You work in a repository through tools: list_files, read_file, search, write_file, run_tests and "
          "shell. Find what makes the tests fail, fix the code (not the tests), run the tests, and call submit "
          "when they pass.")


OWN_FIELDS = ("model", "messages", "tools", "tool_choice", "max_tokens", "temperature", "seed", "stream")


def run_episode(task: RepositoryTask, generator: Generator, environment: WorkspaceEnvironment, rl: RlSettings, *,
                temperature: float = 0.0, seed: int = 0, tool_choice: ToolChoice = "auto",
                extra_body: dict[str, Any] | None = None) -> Episode:
    """One episode of `task`, from reset to done; its record. `extra_body`: request fields added to
    every answer's (vLLM's sampling or structured-output fields), none of the driver's own."""
    clash = sorted(set(extra_body or {}) & set(OWN_FIELDS))
    if clash:
        raise Invalid(f"--extra-body sets {', '.join(clash)}: the episode sets those itself")
    started = time.monotonic()
    opening = environment.reset()
    reset_s = time.monotonic() - started
    turns: list[Turn] = []
    while True:
        body = {**(extra_body or {}), "model": generator.model, "messages": conversation(SYSTEM, opening, turns),
                "tools": TOOL_SCHEMAS,
                "tool_choice": tool_choice, "max_tokens": rl.episode_answer_tokens, "temperature": temperature,
                "seed": seed}
        asked = time.monotonic()
        answered = generator.chat(body, f"episode of {task.id}")
        generation_s = round(time.monotonic() - asked, 3)
        if isinstance(answered, Refused):  # this answer refused (its call failed the schema, say): said, and on
            result = environment.step([], rl.episode_answer_tokens, refused=True)  # its tokens unknown: the most
            turns.append(Turn(request_id=_request_id(answered.request_id), content="",
                              completion_tokens=rl.episode_answer_tokens, generation_s=generation_s, tools=[],
                              refused=answered.reason))
        else:
            content, calls, tokens = _answer(answered, rl.episode_answer_tokens)
            result = environment.step(calls, tokens)
            turns.append(Turn(request_id=_request_id(answered.headers.get("x-request-id")), content=content,
                              completion_tokens=tokens, generation_s=generation_s, tools=result.tools))
        if result.done:
            return _episode(task, generator.model, turns, result, time.monotonic() - started, reset_s, opening)


def _request_id(header: str | None) -> str | None:
    return header[:200] if header else None


def _answer(response: httpx.Response, most: int) -> tuple[str, list[Call], int]:
    """The text, tool calls and completion tokens of a chat completion; Unavailable if it is not
    one. Tokens the engine did not count are counted as `most`."""
    try:
        body = response.json()
        message = body["choices"][0]["message"]
        content = message.get("content") or ""
        calls = [Call(str(c["id"]), str(c["function"]["name"]), str(c["function"]["arguments"]))
                 for c in message.get("tool_calls") or []]
        tokens = (body.get("usage") or {}).get("completion_tokens")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise Unavailable(f"the gateway's answer is not a chat completion: {response.text[:200]!r}") from exc
    if not isinstance(content, str):
        raise Unavailable("the gateway's answer's content is not text")
    counted = tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0 else most
    return content.encode("utf-8", "replace").decode("utf-8"), calls, counted


def _episode(task: RepositoryTask, model: str, turns: list[Turn], result: StepResult, seconds: float,
             reset_s: float, opening: str) -> Episode:
    assert result.ended is not None
    return Episode(task=task.id, model=model, turns=turns, ended=result.ended, reason=result.reason,
                   reward=result.reward, tests_passed=result.tests_passed, tests_total=result.tests_total,
                   workspace_sha256=result.workspace_sha256, seconds=round(seconds, 3), reset_s=round(reset_s, 3),
                   system=SYSTEM, opening=opening)
