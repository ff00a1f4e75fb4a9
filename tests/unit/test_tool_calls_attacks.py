"""Attacks on the tool-call check (serve.tool_calls, its use in serve.sse_relay): calls that do not
match the request's schemas reaching the client, client schemas that crash or hold the gateway,
what the refusal and the audit record show, streamed and whole answers that differ.

Each test states the property the feature should have; those that fail show a finding."""

from __future__ import annotations

import copy
import json
import re
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from appliance.settings import ComplianceSettings
from serve.answer import Answer
from serve.compliance import Compliance, Marks
from serve.errors import GatewayError
from serve.sse_relay import Checks
from serve.tool_calls import InvalidToolCall, ToolCheck
from tests.unit.test_relay_stream import Engine, relay

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
CARD = "4111 1111 1111 1111"


class Hung(BaseException):
    """The check ran past its bound (a BaseException: nothing inside jsonschema swallows it)."""


@contextmanager
def at_most(seconds: float) -> Iterator[None]:
    def ring(*_: object) -> None:
        raise Hung(f"still checking after {seconds} s")
    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def tools_of(parameters: object) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


def verdict(parameters: object, arguments: str) -> str:
    """'400' (refused at request time), 'refused' or 'passed'; anything else escapes (a 500)."""
    try:
        found = ToolCheck.of(tools_of(parameters), "auto")
    except GatewayError as exc:
        assert exc.status == 400
        return "400"
    assert found is not None
    return "passed" if found.problem("f", arguments) is None else "refused"


def line(body: object) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def call_delta(choice: object, calls: list[dict[str, Any]], finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": choice, "delta": {"tool_calls": calls}, "finish_reason": finish}]}


def call(index: object, name: str, arguments: str, id: str = "c1") -> dict[str, Any]:
    return {"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": arguments}}


def spec_sse(raw: bytes) -> list[dict[str, Any]]:
    """The events a client following the SSE spec (and OpenAI's SDKs) reads from `raw`: lines end
    in CRLF, LF or CR, an event's `data:` lines are joined with LF, a blank line dispatches it."""
    events, data = [], []
    for text in re.split(r"\r\n|\r|\n", raw.decode("utf-8", "replace")):
        if text == "":
            payload, data = "\n".join(data), []
            if payload and payload != "[DONE]":
                try:
                    events.append(json.loads(payload))
                except ValueError:
                    pass
        elif text.startswith("data:"):
            data.append(text[6:] if text.startswith("data: ") else text[5:])
    return events


def accumulated(events: list[dict[str, Any]]) -> dict[tuple[Any, Any], dict[str, str]]:
    """The calls a client rebuilds from stream deltas, as OpenAI's SDK does (by choice and call
    index, strings concatenated)."""
    calls: dict[tuple[Any, Any], dict[str, str]] = {}
    for event in events:
        for choice in event.get("choices") or []:
            for delta in (choice.get("delta") or {}).get("tool_calls") or []:
                entry = calls.setdefault((choice.get("index"), delta.get("index")), {"name": "", "arguments": ""})
                function = delta.get("function") or {}
                entry["name"] += function.get("name") or ""
                entry["arguments"] += function.get("arguments") or ""
    return calls


def weather_check() -> ToolCheck:
    found = ToolCheck.of([WEATHER, TIME], "auto")
    assert found is not None
    return found


# (b) A client's schema: crashes (a 500) and unbounded work on the event loop.


@pytest.mark.parametrize("parameters", [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"$schema": "https://json-schema.org/draft/2019-09/schema", "$recursiveRef": "#"},
    {"$ref": "#", "unevaluatedProperties": False},
], ids=["ref-root", "defs-cycle", "recursiveRef", "unevaluated"])
def test_a_self_referencing_schema_is_refused_not_a_recursion_error(parameters: object) -> None:
    assert verdict(parameters, '{"a": 1}') in ("400", "refused")


@pytest.mark.parametrize("ref", ["#/$defs/nope", "#nope", "#/%zz"])
def test_a_dangling_local_ref_is_a_400_not_a_500(ref: str) -> None:
    assert verdict({"type": "object", "properties": {"a": {"$ref": ref}}}, '{"a": 1}') in ("400", "refused")


@pytest.mark.parametrize(("parameters", "arguments"), [
    ({"type": "object"}, '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}}, '{"a": ' * 400 + "{}" + "}" * 400),
], ids=["json-depth", "recursive-schema-depth"])
def test_deeply_nested_arguments_from_the_model_are_refused_not_a_recursion_error(parameters: object,
                                                                                   arguments: str) -> None:
    assert verdict(parameters, arguments) in ("400", "refused")  # a recursive schema is refused up front


@pytest.mark.parametrize("parameters", [
    {"$schema": 5}, {"$schema": []},
    {"type": "object", "properties": {"a": {"pattern": "a{4294967296}"}}},
    {"type": "object", "properties": {"a": {"pattern": "(" * 3000 + ")" * 3000}}},
], ids=["schema-int", "schema-list", "pattern-overflow", "pattern-nesting"])
def test_a_malformed_dialect_or_pattern_is_a_400_not_a_500(parameters: object) -> None:
    assert verdict(parameters, "{}") == "400"


def test_a_schema_whose_refs_fan_out_exponentially_cannot_hold_the_gateway() -> None:
    """2^30 evaluations of `{}` from a 2 KiB schema; the check runs on the event loop."""
    defs: dict[str, Any] = {"a0": {"type": "object"}}
    for level in range(1, 31):
        defs[f"a{level}"] = {"allOf": [{"$ref": f"#/$defs/a{level - 1}"}] * 2}
    with at_most(2.0):
        assert verdict({"$defs": defs, "$ref": "#/$defs/a30"}, "{}") in ("400", "refused", "passed")


@pytest.mark.parametrize("parameters", [
    # A $ref resolved against a nested $id is not what the walk counted (2^20 branches of anyOf).
    {"type": "object", "$defs": {f"l{i}": {} for i in range(21)}, "properties": {"a": {
        "$id": "urn:inner", "$ref": "#/$defs/l0", "$defs": {
            **{f"l{i}": {"anyOf": [{"$ref": f"#/$defs/l{i + 1}"}] * 2} for i in range(20)}, "l20": {}}}}},
    # Draft 3's `extends` is not walked: a patternProperties (Python's re, no timeout) hides in it.
    {"$schema": "http://json-schema.org/draft-03/schema#", "extends": {"patternProperties": {"^(a+)+$": {}}}},
], ids=["nested-id", "draft-3"])
def test_a_schema_that_hides_work_from_the_walk_is_a_400(parameters: object) -> None:
    assert verdict(parameters, "{}") == "400"


def test_every_keyword_counts_against_the_budget_not_only_patterns() -> None:
    """An enum of 8,000 against an array of 8,000: quadratic, about 70 s unbounded."""
    parameters = {"type": "object", "properties": {"a": {"type": "array", "items": {"enum": list(range(8000))}}}}
    found = ToolCheck.of(tools_of(parameters), "auto")
    assert found is not None
    with at_most(5.0):  # a guard against a hang, not a measure
        said = found.problem("f", json.dumps({"a": [7999] * 8000}))
    assert said is not None and "took over" in said


def test_pattern_time_is_bounded_per_answer_not_per_pattern() -> None:
    """Each pattern gets its own 50 ms: forty in an anyOf take two seconds on one string."""
    parameters = {"type": "object", "properties": {"s": {"anyOf": [{"pattern": "(a|aa)+$"}] * 40}}}
    found = ToolCheck.of(tools_of(parameters), "auto")
    assert found is not None
    with at_most(5.0):  # a guard against a hang, not a measure
        said = found.problem("f", json.dumps({"s": "a" * 5000 + "b"}))
    assert said is not None and "took over" in said


def test_unique_items_on_a_model_made_array_is_bounded() -> None:
    """jsonschema compares unsortable items pairwise: 2000 small objects, seconds of event loop."""
    arguments = json.dumps({"a": [{"": n} for n in range(2000)]})
    started = time.monotonic()
    with at_most(3.0):
        verdict({"type": "object", "properties": {"a": {"uniqueItems": True}}}, arguments)
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize("parameters", [
    {"type": "object", "properties": {"$ref": {"type": "string"}}},
    {"type": "object", "properties": {"patternProperties": {"type": "string"}}},
    {"type": "object", "properties": {"u": {"const": {"$ref": "https://example.com"}}}},
], ids=["property-named-ref", "property-named-patternProperties", "const-holding-ref"])
def test_a_keyword_name_used_as_data_is_not_refused(parameters: object) -> None:
    assert verdict(parameters, "{}") == "passed"


# (a) Calls that do not match still reaching the client as calls.


@pytest.mark.parametrize(("bounds", "arguments"), [
    ({"minimum": 0, "maximum": 10}, '{"n": NaN}'), ({"minimum": 0}, '{"n": Infinity}'),
    ({"minimum": 0}, '{"n": 1e400}')])
def test_arguments_that_are_not_json_numbers_are_refused(bounds: dict[str, int], arguments: str) -> None:
    """Python's json reads NaN/Infinity (1e400 too, as inf); NaN passes any bounds. None is JSON."""
    assert verdict({"type": "object", "properties": {"n": {"type": "number", **bounds}}}, arguments) == "refused"


def test_arguments_with_a_duplicate_key_are_refused() -> None:
    """Checked: the last n (5). A first-wins parser, or a strict one, sees otherwise."""
    assert verdict({"type": "object", "properties": {"n": {"maximum": 10}}}, '{"n": 1000, "n": 5}') == "refused"


@pytest.mark.parametrize("message", [
    {"role": "assistant", "function_call": {"name": "delete_everything", "arguments": "{}"}},
    {"role": "assistant", "tool_calls": {"id": "c1", "type": "function",
                                         "function": {"name": "delete_everything", "arguments": "{}"}}},
], ids=["legacy-function_call", "tool_calls-not-a-list"])
def test_a_whole_answer_with_calls_of_another_shape_fails_closed(message: dict[str, Any]) -> None:
    body = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": message}]}
    with pytest.raises(InvalidToolCall):
        weather_check().answer(body)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_tool_choice_that_demands_a_call_refuses_an_answer_without_one(choice: object) -> None:
    found = ToolCheck.of([WEATHER, TIME], choice)
    assert found is not None
    with pytest.raises(InvalidToolCall):
        found.answer({"choices": [{"index": 0, "finish_reason": "stop", "message": {"content": "no"}}]})


def test_calls_after_their_choice_finished_never_rebuild_into_a_call_that_does_not_match() -> None:
    check = weather_check()
    events = [call_delta(0, [call(0, "get_weather", '{"city": "Paris"}')], "tool_calls"),
              call_delta(0, [call(0, "get_weather", '{"city": "Oslo"}', "c2")])]
    with pytest.raises(InvalidToolCall, match="sent tool calls after it finished"):
        [check.event(copy.deepcopy(e)) for e in events]


def test_a_call_of_an_odd_choice_index_is_not_given_to_choice_0() -> None:
    check = weather_check()
    events = [call_delta(0, [call(0, "get_weather", '{"city": "Paris"}')], "tool_calls"),
              call_delta("1", [call(0, "get_time", "{}", "c2")], "tool_calls")]
    with pytest.raises(InvalidToolCall, match="a choice index '1' that is not a number"):
        [check.event(copy.deepcopy(e)) for e in events]


SMUGGLED = json.dumps(call_delta(0, [call(0, "delete_everything", "{}")], "tool_calls"))


@pytest.mark.parametrize("chunks", [
    # One event in two `data:` lines: neither is JSON to the relay; the client joins them.
    [("data: " + SMUGGLED.replace('"tool_calls": [', '"tool_calls":\ndata: [', 1) + "\n\n").encode(),
     b"data: [DONE]\n\n"],
    # CR line endings (valid SSE) after the last LF: kept as an unfinished line and sent unread.
    [line({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}),
     ("data: " + SMUGGLED + "\r\rdata: [DONE]\r\r").encode()],
], ids=["multi-line-data", "cr-line-endings"])
def test_an_event_the_relay_cannot_read_never_smuggles_a_call(chunks: list[bytes]) -> None:
    got, _, _ = relay(Engine(chunks), checks=Checks(tools=weather_check()))
    assert not accumulated(spec_sse(b"".join(got))), "a call no check saw reached the client"


@pytest.mark.parametrize("odd", [{"index": "1"}, {"index": [0]}], ids=["mixed-types", "unhashable"])
def test_odd_call_indexes_end_the_stream_in_an_error_not_an_exception(odd: dict[str, Any]) -> None:
    calls = [call(0, "get_weather", '{"city": "Paris"}'), {**call(1, "get_time", "{}", "c2"), **odd}]
    got, _, _ = relay(Engine([line(call_delta(0, calls, "tool_calls")), b"data: [DONE]\n\n"]),
                      checks=Checks(tools=weather_check()))
    assert b"".join(got).endswith(b"data: [DONE]\n\n")


def card_check(card: dict[str, Any]) -> ToolCheck:
    found = ToolCheck.of([{"type": "function", "function": {"name": "pay", "parameters": {
        "type": "object", "properties": {"card": card}, "required": ["card"]}}}], "auto")
    assert found is not None
    return found


def screen() -> Any:
    compliance = Compliance(ComplianceSettings())
    found = compliance.answer_filter(compliance.policy(["user"]), Marks())  # payment cards redacted
    assert found is not None
    return found


@pytest.mark.parametrize(("card", "arguments"), [
    ({"type": "integer"}, '{"card": 4111111111111111}'),
    ({"type": "string", "pattern": "^[0-9 ]+$"}, json.dumps({"card": CARD})),
], ids=["number-becomes-bare-word", "string-breaks-pattern"])
def test_redaction_after_the_check_never_sends_a_call_that_does_not_match(card: dict[str, Any],
                                                                           arguments: str) -> None:
    check = card_check(card)
    events = [line(call_delta(0, [call(0, "pay", arguments)], "tool_calls")), b"data: [DONE]\n\n"]
    got, _, _ = relay(Engine(events), checks=Checks(screen=screen(), tools=check))
    for rebuilt in accumulated(spec_sse(b"".join(got))).values():
        assert card_check(card).problem(rebuilt["name"], rebuilt["arguments"]) is None, rebuilt
    # The whole path (serve.relay._forward) runs screen.answer, then tools.answer: refused, not sent.
    body = {"choices": [{"index": 0, "message": {"tool_calls": [call(0, "pay", arguments)]}}]}
    with pytest.raises(InvalidToolCall):
        card_check(card).answer(screen().answer(body))


# (c) What the refusal and the record show.


def test_a_refusal_never_shows_the_client_what_redaction_hides() -> None:
    """Under a policy redacting cards, a schema no value matches turns the refusal into an oracle."""
    events = [line(call_delta(0, [call(0, "pay", json.dumps({"card": CARD}))], "tool_calls")), b"data: [DONE]\n\n"]
    got, _, _ = relay(Engine(events), checks=Checks(screen=screen(), tools=card_check({"pattern": "^$"})))
    sent = b"".join(got).decode()
    assert "invalid_tool_call" in sent and "4111" not in sent


def test_a_stream_cut_short_still_records_the_calls_the_model_made() -> None:
    answer = Answer()
    cut = [line(call_delta(0, [call(0, "get_weather", '{"city": "Paris"}')]))]  # no finish, no [DONE]
    relay(Engine(cut), answer=answer, checks=Checks(tools=weather_check()))
    assert answer.tools_called == ["get_weather"], "the record drops what the model did"


def test_a_refused_stream_records_every_choice_it_held() -> None:
    answer = Answer()
    events = [line(call_delta(1, [call(0, "get_time", "{}", "c2")])),
              line(call_delta(0, [call(0, "get_weather", "{}")], "tool_calls")), b"data: [DONE]\n\n"]
    relay(Engine(events), answer=answer, checks=Checks(tools=weather_check()))
    assert sorted(answer.tools_called) == ["get_time", "get_weather"]

