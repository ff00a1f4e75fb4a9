"""Tool calls through the real gateway and vLLM: the session appliance's demo model is served with
vLLM's hermes parser (tests/integration/conftest.py), and the model is made to write a call with
structured output in auto mode, which the parser returns as a call. Through the official `openai`
client, a call that matches its schema goes out the same streamed or not, and the audit record
lists the calls and their arguments' keyed hashes in order; a call that does not match never
reaches the client as a call, streamed or not, and is recorded; the metrics count both."""

from __future__ import annotations

import hashlib
import hmac
import json

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.secrets import secret
from audit.keys import HMAC_SECRET
from audit.writer import log_files
from tests.integration.conftest import Running
from tests.integration.realm import Realm
from tests.support.scrape import gateway_metrics
from tests.support.waiting import until

MODEL = "SmolLM2-135M-Instruct"
PASSWORD = "Tools-password-1"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
          "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": SCHEMA}}]
ASKED = [{"role": "user", "content": "What is the weather in Oslo, in celsius?"}]
# What the engine is made to write in auto mode (a regex): calls the hermes parser takes, one
# matching the schema and one naming an argument it does not have.
RIGHT = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Oslo", "unit": "celsius"\}\}\n</tool_call>'
WRONG = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"town": "Oslo"\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def realm(running: Running) -> Realm:
    realm = Realm(running)
    realm.ensure_user("tools-user", PASSWORD, ["user"])
    return realm


@pytest.fixture(scope="module")
def client(realm: Realm) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{realm.gateway}/v1", api_key=realm.token("tools-user", PASSWORD),
                         max_retries=0, timeout=300)


def records_of(running: Running, request_id: str) -> list[dict]:
    return [json.loads(line) for path in log_files(running.appliance.home.audit)
            for line in path.read_bytes().splitlines() if json.loads(line).get("request_id") == request_id]


def record_of(running: Running, request_id: str) -> dict:
    [record] = until(lambda: records_of(running, request_id), f"the audit record of {request_id}", 60)
    return record


def keyed(running: Running, text: str) -> str:
    key = secret(running.appliance.home, HMAC_SECRET).encode()
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def tool_metric(realm: Realm, outcome: str) -> float:
    """gateway_tool_calls_total of the demo model with `outcome`, from the gateway's exposition."""
    for family in text_string_to_metric_families(gateway_metrics(realm.gateway, realm.running.appliance.home)):
        for sample in family.samples:
            if sample.name == "gateway_tool_calls_total" and sample.labels == {"model": MODEL, "outcome": outcome}:
                return sample.value
    return 0.0


def test_a_call_that_matches_its_schema_goes_out_the_same_streamed_or_not(client: openai.OpenAI,
                                                                           realm: Realm, running: Running) -> None:
    passed_before = tool_metric(realm, "passed")
    forced = {"structured_outputs": {"regex": RIGHT}}
    whole = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=ASKED, tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=96,  # type: ignore[arg-type]
        extra_body=forced)
    answer = whole.parse()
    [call] = answer.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)  # type: ignore[union-attr]

    streamed: dict[int, dict[str, str]] = {}
    with client.chat.completions.with_streaming_response.create(
            model=MODEL, messages=ASKED, tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=96,  # type: ignore[arg-type]
            stream=True, extra_body=forced) as raw:
        for chunk in raw.parse():
            for delta_call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                entry = streamed.setdefault(delta_call.index, {"name": "", "arguments": ""})
                if delta_call.function is not None:
                    entry["name"] += delta_call.function.name or ""
                    entry["arguments"] += delta_call.function.arguments or ""
        stream_id = raw.headers["x-request-id"]
    assert list(streamed.values()) == [{"name": "get_weather", "arguments": call.function.arguments}]  # type: ignore[union-attr]

    for request_id in (whole.headers["x-request-id"], stream_id):
        record = record_of(running, request_id)
        assert record["tools_called"] == ["get_weather"]
        assert record["tool_arguments_hmac"] == [keyed(running, call.function.arguments)]  # type: ignore[union-attr]
    assert tool_metric(realm, "passed") >= passed_before + 2


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_that_does_not_match_its_schema_never_reaches_the_client_as_a_call(
        realm: Realm, running: Running, stream: bool) -> None:
    refused_before = tool_metric(realm, "refused")
    answered = httpx.post(f"{realm.gateway}/v1/chat/completions", timeout=300,
                          headers={"Authorization": f"Bearer {realm.token('tools-user', PASSWORD)}"},
                          json={"model": MODEL, "messages": ASKED, "tools": TOOLS, "tool_choice": "auto",
                                "temperature": 0, "max_tokens": 96, "stream": stream,
                                "structured_outputs": {"regex": WRONG}})
    if stream:
        assert answered.status_code == 200
        events = [json.loads(line[len("data: "):]) for line in answered.text.splitlines()
                  if line.startswith("data: {")]
        assert not any(c.get("delta", {}).get("tool_calls") for e in events for c in e.get("choices", []))
        [error] = [e["error"] for e in events if "error" in e]
        assert answered.text.endswith("data: [DONE]\n\n")
    else:
        assert answered.status_code == 502, answered.text
        assert "tool_calls" not in answered.text
        error = answered.json()["error"]
    assert error["code"] == "invalid_tool_call" and "do not match the schema of get_weather" in error["message"], error
    record = record_of(running, answered.headers["x-request-id"])
    assert record["tools_called"] == ["get_weather"], "the record names what the model tried"
    assert record["tool_arguments_hmac"] == [keyed(running, '{"town": "Oslo"}')]
    if not stream:
        assert (record["status"], record["reason"]) == (502, "invalid_tool_call")
    assert tool_metric(realm, "refused") >= refused_before + 1
