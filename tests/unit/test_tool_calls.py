"""Tool calls checked against the request's functions before they reach the client: whole answers
and streams alike, hostile schemas refused or bounded."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from serve.errors import GatewayError
from serve.tool_calls import InvalidToolCall, ToolCheck

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
                                     "unit": {"enum": ["c", "f"]}},
    "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: any object


def check(tool_choice: object = "auto", tools: list[dict[str, Any]] | None = None) -> ToolCheck:
    found = ToolCheck.of(tools or [WEATHER, TIME], tool_choice)
    assert found is not None
    return found


def whole(*calls: tuple[str, str]) -> dict[str, Any]:
    return {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "tool_calls": [
        {"id": f"call-{n}", "type": "function", "function": {"name": name, "arguments": arguments}}
        for n, (name, arguments) in enumerate(calls)]}}]}


def streamed(body: dict[str, Any], pieces: int = 3) -> list[dict[str, Any]]:
    """The events an engine streams for `body`: each call's arguments in `pieces` deltas."""
    events: list[dict[str, Any]] = [{"choices": [{"index": 0, "delta": {"role": "assistant"}}]}]
    for n, call in enumerate(body["choices"][0]["message"]["tool_calls"]):
        arguments = call["function"]["arguments"]
        step = max(1, len(arguments) // pieces)
        events.append({"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": n, "id": call["id"], "type": "function", "function": {"name": call["function"]["name"],
                                                                         "arguments": ""}}]}}]})
        for start in range(0, len(arguments), step):
            events.append({"choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": n, "function": {"arguments": arguments[start:start + step]}}]}}]})
    events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    return events


def relayed(tool_check: ToolCheck, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = [tool_check.event(copy.deepcopy(e)) for e in events]
    return out + tool_check.finish()


def calls_out(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [call for e in events for c in e["choices"] for call in c.get("delta", {}).get("tool_calls", [])]


def test_a_call_matching_its_schema_passes_whole_and_streamed_identically() -> None:
    body = whole(("get_weather", '{"city": "Paris", "unit": "c"}'), ("get_time", "{}"))
    assert check().answer(copy.deepcopy(body)) == body
    out = relayed(check(), streamed(body))
    sent = calls_out(out)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in sent] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in body["choices"][0]["message"]["tool_calls"]]
    assert [c["id"] for c in sent] == ["call-0", "call-1"] and [c["index"] for c in sent] == [0, 1]
    # nothing of a call went out before the event that finished its choice, which carries them all
    assert all("tool_calls" not in e["choices"][0].get("delta", {}) for e in out[:-1])
    assert out[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(("call", "choice", "said"), [
    (("get_wether", '{"city": "Paris"}'), "auto", "'get_wether', which is not among the request's tools"),
    (("get_weather", '{"city": "Paris"'), "auto", "its arguments are not JSON"),
    (("get_weather", '["Paris"]'), "auto", "its arguments are not a JSON object"),
    (("get_weather", "{}"), "auto", 'at $: fails required ["city"]'),
    (("get_weather", '{"city": "Paris", "unit": "k"}'), "auto", 'at $.unit: fails enum ["c", "f"]'),
    (("get_weather", '{"city": "paris"}'), "auto", "at $.city: does not match the pattern '^[A-Z][a-z]+$'"),
    (("get_weather", '{"city": "Paris", "x": 1}'), "auto", "at $: fails additionalProperties false"),
    (("get_time", "{}"), {"type": "function", "function": {"name": "get_weather"}}, "tool_choice names 'get_weather'"),
    (("get_time", "{}"), "none", 'tool_choice was "none"'),
])
def test_a_call_that_does_not_match_never_goes_out_as_a_call(call: tuple[str, str], choice: object,
                                                               said: str) -> None:
    with pytest.raises(InvalidToolCall, match="refused") as refused:
        check(choice).answer(whole(call))
    assert said in refused.value.message and refused.value.status == 502
    assert refused.value.code == "invalid_tool_call"
    stream = check(choice)
    with pytest.raises(InvalidToolCall) as in_stream:
        relayed(stream, streamed(whole(call)))
    assert said in in_stream.value.message


def test_a_stream_that_ends_without_finishing_its_choice_still_has_its_calls_checked() -> None:
    events = streamed(whole(("get_weather", '{"city": "Paris"}')))[:-1]
    out = relayed(check(), events)
    assert [c["function"]["arguments"] for c in calls_out(out)] == ['{"city": "Paris"}']
    with pytest.raises(InvalidToolCall):
        relayed(check(), streamed(whole(("get_weather", '{"town": "Paris"}')))[:-1])


@given(arguments=st.dictionaries(st.sampled_from(["city", "unit"]), st.text(max_size=20), max_size=2),
       pieces=st.integers(1, 12))
def test_streamed_and_whole_answers_carry_identical_calls_or_are_both_refused(arguments: dict[str, str],
                                                                              pieces: int) -> None:
    body = whole(("get_weather", json.dumps(arguments, ensure_ascii=False)))
    try:
        check().answer(copy.deepcopy(body))
        whole_said = None
    except InvalidToolCall as exc:
        whole_said = exc.message
    try:
        sent = calls_out(relayed(check(), streamed(body, pieces)))
        stream_said = None
    except InvalidToolCall as exc:
        stream_said, sent = exc.message, []
    assert whole_said == stream_said
    if whole_said is None:
        assert [c["function"] for c in sent] == [c["function"] for c in body["choices"][0]["message"]["tool_calls"]]


@pytest.mark.parametrize(("tools", "choice", "param", "said"), [
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}], "auto",
     "tools[0].function.parameters", "not a JSON schema"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"$ref": "https://example.com/s.json"}}}],
     "auto", "tools[0].function.parameters", "may refer only inside itself"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "file:///etc/passwd"}}}}}], "auto",
     "tools[0].function.parameters", "$ref"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"patternProperties": {"(a+)+$": {}}}}}],
     "auto", "tools[0].function.parameters", "patternProperties"),
    ([TIME, TIME], "auto", "tools[1].function.name", "a second function named 'get_time'"),
    ([TIME], {"type": "function", "function": {"name": "get_weather"}}, "tool_choice", "not among the tools"),
    ([TIME], {"type": "function", "function": ["get_time"]}, "tool_choice", "not among the tools"),
])
def test_schemas_and_choices_that_cannot_be_checked_are_refused_when_the_request_arrives(
        tools: list[dict[str, Any]], choice: object, param: str, said: str) -> None:
    with pytest.raises(GatewayError) as refused:
        ToolCheck.of(tools, choice)
    assert refused.value.status == 400 and refused.value.param == param and said in refused.value.message


def test_local_references_resolve_and_no_tools_means_no_check() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "$defs": {"city": {"type": "string"}}, "type": "object", "properties": {"c": {"$ref": "#/$defs/city"}}}}}]
    found = ToolCheck.of(tools, "auto")
    assert found is not None and found.problem("f", '{"c": "Oslo"}') is None
    assert 'at $.c: fails type "string"' in (found.problem("f", '{"c": 3}') or "")
    assert ToolCheck.of(None, "auto") is None and ToolCheck.of([], None) is None


@pytest.mark.parametrize(("pattern", "value"), [("^(a+)+$", "a" * 40 + "!"), ("^(a|a?)+$", "a" * 40 + "!"),
                                               ("(x+x+)+y", "x" * 40), ("^(\\w+\\s?)*$", "an" * 30 + "!")])
def test_a_catastrophic_pattern_never_holds_the_gateway(pattern: str, value: str) -> None:
    """Patterns that backtrack for hours in Python's `re` are refused at once: the `regex` module
    does not backtrack on them, and a pattern that would is cut off after PATTERN_TIMEOUT_S."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}}}}]
    found = ToolCheck.of(tools, "auto")
    assert found is not None
    said = found.problem("f", json.dumps({"s": value}))  # in Python's `re`, hours: this test would not end
    assert said is not None and ("does not match" in said or "took over" in said)
