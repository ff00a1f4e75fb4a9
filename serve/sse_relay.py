"""Relaying an engine's server-sent events to the client, line by line as they arrive, while
the answer is gathered for the audit record and the relay's listener (`StreamListener`) is told
the first token, the usage and the end marker. An error event the engine sends inside the stream
goes on in OpenAI's error shape (serve.errors.stream_error)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import anyio

from serve.answer import Answer, decode_json
from serve.compliance import AnswerFilter
from serve.errors import stream_error
from serve.response_cache import Capture
from serve.tool_calls import InvalidToolCall, ToolCheck

END = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Checks:
    """What an answer passes through before it goes out: its text screened for sensitive data, then
    its tool calls (as redacted: the calls that would go out) checked against the request's
    functions (None: not asked for)."""

    screen: AnswerFilter | None = None
    tools: ToolCheck | None = None


class StreamListener(Protocol):
    """What the relay tells as a stream passes: `answer` gathers what the engine said."""

    @property
    def answer(self) -> Answer: ...

    def first_token(self) -> None:
        """The first chunk with text (or a tool call) has arrived."""

    def usage(self, prompt_tokens: int | None, completion_tokens: int) -> None:
        """The stream's tokens, once, before its end marker goes on (prompt None: not known)."""

    def end(self) -> None:
        """The end marker has arrived; the bytes holding it go on next."""


def usage_of(answer: object) -> tuple[int, int]:
    """(prompt, completion) tokens from a parsed OpenAI response or final stream chunk."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    if not isinstance(usage, dict):
        return 0, 0
    return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)


async def relay_stream(response: aiohttp.ClientResponse, listener: StreamListener,
                       checks: Checks = Checks(), sent: Capture | None = None,
                       model: str | None = None) -> AsyncIterator[bytes]:
    """Pass SSE through line by line as it arrives; gather the answer into `listener.answer`, and
    tell the listener the first token, the usage and the end marker.

    Only complete lines are passed on, and the end is found by parsing them: `listener.end` runs when
    the line `data: [DONE]` has arrived and before the bytes holding it go on (a prompt echoed
    back inside an event's JSON never ends the stream early).

    Usage is reported once, before the end marker goes on: the last usage seen (a client that
    asked for continuous usage gets running totals in every chunk), or, for a stream cut short
    before its usage chunk, prompt unknown (None) and one completion token per text chunk seen.

    An error event goes out re-encoded in the gateway's error shape, whatever else the chunk held
    going out unchanged.

    With `checks.tools`, each choice's tool calls are held back until it finishes and go out whole
    with the event that finishes it; a call that does not match the request's functions goes out as
    an error event instead, and the stream ends there (serve.tool_calls).

    With `checks.screen` (compliance filtering), each event goes out re-encoded with its text redacted,
    and what it still held goes out in events of its own before the end marker. With `sent`, each
    chunk is also added to it before it goes on (the response cache keeps what the client got).

    With `model`, each event naming another model goes out re-encoded naming `model` instead (an
    adapter's answers name the alias asked for, not the version that answered).

    When the client goes away, the server cancels this generator; closing the upstream connection
    then makes vLLM abort the request, freeing the engine.
    """
    answer = listener.answer
    screen, tools = checks.screen, checks.tools
    first = True
    pending = b""
    finished = False
    usage: tuple[int | None, int] | None = None
    text_chunks = 0
    reported = False
    refused_calls = False
    ended = False

    def report() -> None:
        nonlocal reported
        if not reported:
            reported = True
            listener.usage(*(usage if usage is not None else (None, text_chunks)))

    try:
        async for chunk in response.content.iter_any():
            pending += chunk
            cut = pending.rfind(b"\n") + 1
            if not cut:
                continue
            complete, pending = pending[:cut], pending[cut:]
            lines = []
            rewritten = screen is not None or tools is not None
            for line in complete.splitlines(keepends=True):
                lines.append(line)
                if line.rstrip(b"\r\n") == b"data: [DONE]":
                    # What the filter held back goes out before the end, then calls never finished.
                    held = screen.finish() if screen is not None else []
                    if tools is not None:
                        try:
                            held = await anyio.to_thread.run_sync(_last_calls, tools, held)
                        except InvalidToolCall as refused:
                            lines[-1:] = [_refusal(refused, answer), line]
                            held, refused_calls = [], True
                    if held:
                        lines[-1:] = [*(_event_line(event) + b"\n" for event in held), line]
                        for extra in held:
                            answer.add_choices(extra.get("choices"))
                    report()
                    listener.end()
                    ended = True
                    continue
                if not line.startswith(b"data:"):
                    continue
                try:
                    event = decode_json(line[len(b"data:"):])
                except ValueError:
                    event = None
                if not isinstance(event, dict):
                    answer.add_unparsed(line.rstrip(b"\r\n"))
                    if screen is not None or tools is not None:
                        lines.pop()  # what cannot be screened or checked does not go out
                    continue
                if model is not None and "model" in event and event["model"] != model:
                    event["model"] = model
                    lines[-1], rewritten = _event_line(event), True
                if "error" in event:
                    answer.failed = True
                    event = stream_error(event)
                    lines[-1], rewritten = _event_line(event), True
                if screen is not None:  # redacted first: the calls checked are those that go out
                    event = screen.event(event)
                    lines[-1] = _event_line(event)
                if tools is not None and "error" not in event:
                    try:  # a choice that finishes has its calls checked, in a thread: a schema may be slow
                        event = await anyio.to_thread.run_sync(tools.event, event) if _finishes(event) \
                            else tools.event(event)
                    except InvalidToolCall as refused:  # the refusal instead of the calls, and the end
                        lines[-1:] = [_refusal(refused, answer), END]
                        refused_calls = True
                        break
                    lines[-1] = _event_line(event)
                answer.note_id(event)
                if answer.add_choices(event.get("choices")):
                    text_chunks += 1
                    if first:
                        first = False
                        listener.first_token()
                if event.get("usage"):
                    usage = usage_of(event)
            out = b"".join(lines) if rewritten else complete
            if refused_calls:
                report()
                if not ended:
                    listener.end()
                yield out  # not kept for the cache: an answer refused is never replayed
                return
            if sent is not None:
                sent.append(out)
            yield out
        if pending:
            answer.add_unparsed(pending)
            if screen is None and tools is None:  # what cannot be screened or checked does not go out
                if sent is not None:
                    sent.append(pending)
                yield pending
        finished = True
    finally:
        if tools is not None and not refused_calls:  # a stream cut short: what the model tried is kept
            for choice in tools.gathered():
                answer.add_choices([choice])
        report()
        if finished:
            response.release()  # the connection goes back to the pool
        else:
            response.close()  # drop the connection: the engine sees the client leave
        if screen is not None:  # last: whatever it raises, the engine is let go first
            screen.settle()


def _finishes(event: dict[str, Any]) -> bool:
    choices = event.get("choices")
    return isinstance(choices, list) and any(isinstance(c, dict) and c.get("finish_reason") is not None
                                             for c in choices)


def _last_calls(tools: ToolCheck, held: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """At the end marker: the filter's held events through the check, then the calls of choices
    the stream never finished."""
    return [tools.event(event) for event in held] + tools.finish()


def _refusal(refused: InvalidToolCall, answer: Answer) -> bytes:
    """The error event that goes out in place of calls that did not match; the answer keeps them
    (the audit record names what the model tried)."""
    answer.failed = True
    answer.add_choices(refused.choices)
    return _event_line(refused.body()) + b"\n"


def _event_line(event: dict[str, Any]) -> bytes:
    """An SSE data line of `event` (ASCII JSON: whatever the text holds, lone surrogates included)."""
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n"
