"""Relaying an engine's SSE stream: bytes pass through unchanged (whole lines at a time), usage is
reported once, before the end marker goes on (running totals or not, cut short or not), and the
end is found by parsing lines, never by a substring."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from serve.answer import Answer
from serve.sse_relay import Checks, relay_stream
from serve.tool_calls import ToolCheck


def event(text: str | None = None, usage: tuple[int, int] | None = None) -> bytes:
    body: dict = {"choices": [{"index": 0, "delta": {"content": text}}] if text else []}
    if usage:
        body["usage"] = {"prompt_tokens": usage[0], "completion_tokens": usage[1]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class Engine:
    """Stands in for aiohttp's response: its body arrives in the given chunks."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.content = self
        self.ended = ""

    async def iter_any(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk

    def release(self) -> None:
        self.ended = "released"

    def close(self) -> None:
        self.ended = "closed"


def relay(engine: Engine, take: int | None = None, ends: list[int] | None = None,
          answer: Answer | None = None, checks: Checks | None = None) -> tuple[list[bytes], list[tuple], list[str]]:
    """What the client got, the usage reports (with how many chunks had gone on before each),
    and the texts seen; `take` chunks only when the client leaves early; `ends` gets how many
    chunks had gone on when the end marker was seen."""
    got: list[bytes] = []
    reports: list[tuple] = []
    answer = answer if answer is not None else Answer()
    texts = answer.text
    ends = ends if ends is not None else []

    class Listener:
        def __init__(self, answer: Answer) -> None:
            self.answer = answer

        def first_token(self) -> None:
            pass

        def usage(self, prompt_tokens: int | None, completion_tokens: int) -> None:
            reports.append((prompt_tokens, completion_tokens, len(got)))

        def end(self) -> None:
            ends.append(len(got))

    async def run() -> None:
        stream = relay_stream(engine, Listener(answer), checks or Checks())  # type: ignore[arg-type]
        async for chunk in stream:
            got.append(chunk)
            if take is not None and len(got) == take:
                await stream.aclose()
                return

    asyncio.run(run())
    return got, reports, texts


def test_bytes_pass_through_and_usage_is_reported_before_the_end_marker() -> None:
    chunks = [event("O"), event("K"), event(usage=(10, 2)) + b"data: [DONE]\n\n"]
    got, reports, texts = relay(Engine(chunks))
    assert got == chunks and texts == ["O", "K"]
    assert reports == [(10, 2, 2)], "reported before the chunk with [DONE] went on"


def test_running_totals_are_reported_once_with_the_last_total() -> None:
    chunks = [event("O", usage=(10, 1)), event("K", usage=(10, 2)), event(usage=(10, 2)), b"data: [DONE]\n\n"]
    engine = Engine(chunks)
    _, reports, _ = relay(engine)
    assert reports == [(10, 2, 3)] and engine.ended == "released"


def test_a_stream_cut_short_reports_its_text_chunks_and_drops_the_connection() -> None:
    engine = Engine([event("O"), event("K"), event("!"), event(usage=(10, 3)), b"data: [DONE]\n\n"])
    got, reports, _ = relay(engine, take=2)
    assert len(got) == 2 and reports == [(None, 2, 2)], "the prompt is not known: the caller estimates it"
    assert engine.ended == "closed", "closing the upstream connection makes vLLM abort the request"


def test_an_event_split_across_reads_is_still_seen() -> None:
    whole = event("OK", usage=(4, 1)) + b"data: [DONE]\n\n"
    ends: list[int] = []
    got, reports, texts = relay(Engine([whole[:7], whole[7:30], whole[30:]]), ends=ends)
    assert b"".join(got) == whole and texts == ["OK"] and reports[0][:2] == (4, 1)
    assert all(chunk.endswith(b"\n") for chunk in got), "only whole lines go on"
    assert ends == [len(got) - 1], "the end was seen before the chunk holding it went on"


def test_an_end_marker_echoed_inside_an_event_does_not_end_the_stream() -> None:
    echoed = event("data: [DONE]\n\n") + event("data: [DONE]")
    ends: list[int] = []
    got, reports, texts = relay(Engine([echoed, event(usage=(9, 2)), b"data: [DONE]\n\n"]), ends=ends)
    assert texts == ["data: [DONE]\n\n", "data: [DONE]"]
    assert ends == [2] and reports == [(9, 2, 2)], "only the real end marker line ends it"


def test_tool_calls_and_invalid_utf8_are_kept_for_the_completion_hash() -> None:
    def call(index: int, name: str | None, arguments: str) -> bytes:
        function = {"arguments": arguments, **({"name": name} if name else {})}
        delta = {"tool_calls": [{"index": index, "function": function}]}
        return b"data: " + json.dumps({"choices": [{"index": 0, "delta": delta}]}).encode() + b"\n\n"

    answer = Answer()
    broken = b'data: {"choices": [{"index": 0, "delta": {"content": "caf\xe9"}}]}\n\n'
    relay(Engine([call(0, "get_weather", '{"city": '), call(0, None, '"Oslo"}'), call(1, "get_time", "{}"),
                  broken, b"data: not json \xff\n\n", b"data: [DONE]\n\n"]), answer=answer)
    assert answer.tools_called == ["get_weather", "get_time"]
    whole = json.loads(answer.canonical())
    assert whole["tool_calls"] == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                                   {"name": "get_time", "arguments": "{}"}]
    assert whole["text"] == "caf\udce9" and whole["unparsed"] == ["data: not json \udcff"]


def test_an_engine_error_inside_the_stream_goes_on_in_openais_shape() -> None:
    failure = {"error": {"message": "Internal server error\n  File \"/opt/vllm/x.py\" in /data/models/m",
                         "type": "InternalServerError", "param": None, "code": 500}}
    error_line = b"data: " + json.dumps(failure).encode() + b"\n"
    answer = Answer()
    got, reports, texts = relay(Engine([event("O"), event("K") + error_line + b"\n" + b"data: [DONE]\n\n"]),
                                answer=answer)
    assert got[0] == event("O") and got[1].startswith(event("K")), "what else the chunk held goes on unchanged"
    sent = [json.loads(line[len(b"data: "):]) for line in got[1].splitlines() if b'"error"' in line]
    assert sent == [{"error": {"message": "Internal server error File \"<path>\" in <path>",
                               "type": "server_error", "param": None, "code": "engine_error"}}]
    assert got[1].endswith(b"\n\ndata: [DONE]\n\n") and answer.failed and texts == ["O", "K"]


def test_each_event_names_the_model_asked_for_when_told_one() -> None:
    """An adapter's stream names its alias, not the version answering (the audit record keeps it)."""
    def named(model: str, text: str | None = None, usage: tuple[int, int] | None = None) -> bytes:
        return event(text, usage).replace(b'{"choices"', b'{"model": "' + model.encode() + b'", "choices"', 1)

    chunks = [named("codes-v2", "O"), named("codes-v2", "K"), named("codes-v2", usage=(3, 2)) + b"data: [DONE]\n\n"]
    answer = Answer()

    class Listener:
        def __init__(self) -> None:
            self.answer = answer

        def first_token(self) -> None:
            pass

        def usage(self, prompt_tokens: int | None, completion_tokens: int) -> None:
            pass

        def end(self) -> None:
            pass

    async def run() -> list[bytes]:
        return [chunk async for chunk in relay_stream(Engine(chunks), Listener(), model="codes")]  # type: ignore[arg-type]

    got = b"".join(asyncio.run(run()))
    events = [json.loads(line[len(b"data: "):]) for line in got.splitlines() if line.startswith(b"data: {")]
    assert [e["model"] for e in events] == ["codes"] * 3 and b"codes-v2" not in got
    assert answer.text == ["O", "K"] and got.endswith(b"data: [DONE]\n\n")
    assert relay(Engine(chunks))[0] == chunks, "without a model to name, the bytes pass through unchanged"


def tool_stream(arguments: str) -> list[bytes]:
    """An engine's stream of one get_weather call, its arguments in two deltas, then the usage."""
    def line(body: dict) -> bytes:
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    half = len(arguments) // 2
    return [line({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}),
            line({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                  "function": {"name": "get_weather", "arguments": arguments[:half]}}]}}]}),
            line({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0,
                  "function": {"arguments": arguments[half:]}}]}}]}),
            line({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}),
            line({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 7}}) + b"data: [DONE]\n\n"]


def weather_check(outcomes: list[str]) -> ToolCheck:
    found = ToolCheck.of([{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}], "auto",
        outcomes.append)
    assert found is not None
    return found


def sent_events(got: list[bytes]) -> list[dict]:
    return [json.loads(line[len(b"data: "):]) for line in b"".join(got).splitlines() if line.startswith(b"data: {")]


def test_a_streamed_call_goes_out_whole_with_the_event_that_finishes_its_choice() -> None:
    outcomes: list[str] = []
    answer = Answer()
    got, reports, _ = relay(Engine(tool_stream('{"city": "Oslo"}')), answer=answer,
                            checks=Checks(tools=weather_check(outcomes)))
    events = sent_events(got)
    with_calls = [e for e in events if e["choices"] and "tool_calls" in e["choices"][0]["delta"]]
    assert len(with_calls) == 1 and with_calls[0]["choices"][0]["finish_reason"] == "tool_calls"
    call = {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert with_calls[0]["choices"][0]["delta"]["tool_calls"] == [{"index": 0, "id": "c1", "type": "function",
                                                                   "function": call}]
    assert outcomes == ["passed"] and reports[0][:2] == (9, 7) and b"".join(got).endswith(b"data: [DONE]\n\n")
    assert answer.tools_called == ["get_weather"] and answer.tool_arguments == ['{"city": "Oslo"}']


def test_a_streamed_call_that_does_not_match_goes_out_as_an_error_and_the_stream_ends() -> None:
    outcomes: list[str] = []
    answer = Answer()
    engine = Engine(tool_stream('{"town": "Oslo"}'))
    got, reports, _ = relay(engine, answer=answer, checks=Checks(tools=weather_check(outcomes)))
    events = sent_events(got)
    assert not any(e.get("choices") and "tool_calls" in e["choices"][0].get("delta", {}) for e in events)
    [error] = [e["error"] for e in events if "error" in e]
    assert error["code"] == "invalid_tool_call" and 'fails required ["city"]' in error["message"]
    assert b"".join(got).endswith(b"data: [DONE]\n\n") and outcomes == ["refused"]
    assert answer.failed and answer.tools_called == ["get_weather"], "the record names what the model tried"
    assert engine.ended == "closed" and len(reports) == 1
