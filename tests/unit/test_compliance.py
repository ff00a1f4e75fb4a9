"""Live compliance filtering apart from the engine: the scanner's detectors (national
identifiers and plug-ins included), redaction of a text arriving in pieces, the per-role policy,
and the gateway's screening of prompts and answers (whole and streamed); and training data
(dataset ingestion, RL export) screened by the same scanner."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from appliance.datasets import load_registry
from appliance.errors import SettingsError
from appliance.home import Home
from appliance.sensitive import Scanner, StreamRedactor, national_ids, plugged
from appliance.settings import CompliancePolicy, ComplianceSettings, RolePolicy, Settings
from finetune.cli import data_app
from finetune.datasets import DatasetError
from finetune.rl.export import prepare_set
from serve.compliance import Compliance, Marks
from serve.errors import GatewayError

CARD = "4111 1111 1111 1111"
TEXT = (f"Pay with card {CARD} today, mail bob.smith@example.co.uk, SSN 123-45-6789, IBAN GB82 WEST 1234 5698 "
        "7654 32 ok. Call +44 20 7946 0958 or use key sk-abcdefghijklmnopqrstuvwxyz123456; NINO AB 12 34 56 C.")
CHAT = ("messages",)


def test_every_kind_is_found_and_replaced_by_its_name() -> None:
    scanner = Scanner(detectors=national_ids())
    assert scanner.redact(TEXT) == ("Pay with card [PAYMENT_CARD] today, mail [EMAIL], SSN [NATIONAL_ID], IBAN [IBAN] "
                                    "ok. Call [PHONE] or use key [SECRET]; NINO [NATIONAL_ID].")
    wrong_checksums = Scanner().findings("4111 1111 1111 1112 and GB82 WEST 1234 5698 7654 33")
    assert not {f.kind for f in wrong_checksums} & {"payment_card", "iban"}


def test_a_streamed_text_is_redacted_as_the_whole_would_be_however_it_is_cut() -> None:
    scanner = Scanner(detectors=national_ids())
    chance = random.Random(21)
    for text in (TEXT, CARD, "x@y.io", "GB82WEST12345698765432", "plain words and 12 numbers 3."):
        whole = scanner.redact(text)
        for _ in range(300):
            stream, out, at = StreamRedactor(scanner, scanner.kinds, 256), "", 0
            while at < len(text):
                step = chance.randint(1, 9)
                out += stream.feed(text[at:at + step])
                at += step
            assert out + stream.flush() == whole, text


def test_a_card_split_across_two_chunks_is_held_back_then_redacted_whole() -> None:
    stream = StreamRedactor(Scanner(), {"payment_card"}, 256)
    assert stream.feed("My card: 4111 11") == "My card: "
    assert stream.feed("11 1111 1111, thanks") == "[PAYMENT_CARD], thanks"
    assert stream.flush() == "" and stream.found == {"payment_card"}


def test_what_is_held_back_is_bounded() -> None:
    stream = StreamRedactor(Scanner(), {"phone", "payment_card"}, 80)
    out = "".join(stream.feed("1" * 50) for _ in range(40))
    assert len(out) >= 2000 - 80 - 50 and len(stream.held) <= 80 + 50


def test_a_role_policy_overrides_the_default_and_the_most_generous_role_wins() -> None:
    settings = ComplianceSettings(roles={"auditor": RolePolicy(prompts={"payment_card": "allow"}),
                                         "intern": RolePolicy(prompts={"email": "block"})})
    compliance = Compliance(settings)
    assert compliance.policy(["user"]).prompts["payment_card"] == "block"
    assert compliance.policy(["user", "auditor"]).prompts["payment_card"] == "allow"
    assert compliance.policy(["intern"]).prompts["email"] == "block"
    assert compliance.policy(["intern", "user"]).prompts["email"] == "flag"
    assert compliance.policy([]).answers["iban"] == "redact"


def test_bad_policies_are_refused_with_the_reason() -> None:
    with pytest.raises(ValidationError, match="an answer cannot be blocked"):
        CompliancePolicy(answers={"email": "block"})
    with pytest.raises(ValidationError, match="employee: not a regular expression"):
        ComplianceSettings(patterns={"employee": "E-(\\d"})
    with pytest.raises(ValidationError, match="a kind is lower-case"):
        ComplianceSettings(patterns={"Bad Kind": "x"})
    with pytest.raises(SettingsError, match="no detector finds \\['passport'\\]"):
        Compliance(ComplianceSettings(roles={"x": RolePolicy(prompts={"passport": "block"})}))
    with pytest.raises(SettingsError, match="no sensitive-data detector 'nope' is installed"):
        plugged(["nope"])


def test_a_blocked_prompt_is_refused_naming_the_kind_and_field_never_the_text() -> None:
    compliance = Compliance(ComplianceSettings())
    marks = Marks()
    payload = {"messages": [{"role": "system", "content": "be brief"},
                            {"role": "user", "content": [{"type": "text", "text": f"charge {CARD}"}]}]}
    with pytest.raises(GatewayError) as refused:
        compliance.screen_prompt(payload, CHAT, compliance.policy(["user"]), marks)
    error = refused.value
    assert (error.status, error.code) == (400, "sensitive_data")
    assert "a payment card number (messages[1].content[0].text)" in error.message and "4111" not in error.message
    assert marks.done == {"prompt.payment_card": "blocked"}


def test_a_prompt_is_redacted_or_flagged_before_the_engine_sees_it() -> None:
    compliance = Compliance(ComplianceSettings(roles={"ops": RolePolicy(prompts={"payment_card": "redact"})}))
    marks = Marks()
    payload = {"messages": [{"role": "user", "content": f"card {CARD}, mail me at a@b.org"}]}
    compliance.screen_prompt(payload, CHAT, compliance.policy(["ops"]), marks)
    assert payload["messages"][0]["content"] == "card [PAYMENT_CARD], mail me at a@b.org"
    assert marks.done == {"prompt.payment_card": "redacted", "prompt.email": "flagged"}


def test_a_prompt_of_token_ids_cannot_be_screened_and_is_refused() -> None:
    compliance = Compliance(ComplianceSettings())
    with pytest.raises(GatewayError) as refused:
        compliance.screen_prompt({"prompt": [1, 2, 3]}, ("prompt",), compliance.policy(["user"]), Marks())
    assert refused.value.code == "sensitive_data" and refused.value.param == "prompt"
    allowed = Compliance(ComplianceSettings(roles={"raw": RolePolicy(prompts={k: "allow" for k in Scanner().kinds}
                                                                     | {"national_id": "allow"})}))
    allowed.screen_prompt({"prompt": [1, 2, 3]}, ("prompt",), allowed.policy(["raw"]), Marks())


def test_a_whole_answer_is_redacted_tool_calls_included_and_flags_are_marked() -> None:
    compliance = Compliance(ComplianceSettings())
    marks = Marks()
    answer = compliance.answer_filter(compliance.policy(["user"]), marks)
    assert answer is not None
    call = {"function": {"name": "pay", "arguments": '{"iban": "GB82 WEST 1234 5698 7654 32"}'}}
    body = answer.answer({"choices": [{"index": 0, "message": {"role": "assistant", "content": f"it is {CARD}",
                                                               "tool_calls": [call]}}],
                          "usage": {"completion_tokens": 9}})
    message = body["choices"][0]["message"]
    assert message["content"] == "it is [PAYMENT_CARD]"
    assert message["tool_calls"][0]["function"]["arguments"] == '{"iban": "[IBAN]"}'
    assert marks.done == {"answer.payment_card": "redacted", "answer.iban": "redacted"}


def test_a_streamed_answer_is_redacted_across_events_and_flushed_before_its_end() -> None:
    compliance = Compliance(ComplianceSettings())
    marks = Marks()
    answer = compliance.answer_filter(compliance.policy(["user"]), marks)
    assert answer is not None
    pieces = ["Card ", "4111 1111", " 1111 11", "11 sent to", " x@y.io"]
    delivered = []
    for position, piece in enumerate(pieces):
        event = {"id": "c1", "object": "chat.completion.chunk", "model": "m",
                 "choices": [{"index": 0, "delta": {"content": piece},
                              "finish_reason": "stop" if position == len(pieces) - 1 else None}]}
        delivered.append(answer.event(event)["choices"][0]["delta"]["content"])
    assert "".join(delivered) == "Card [PAYMENT_CARD] sent to x@y.io"
    assert not any(digit in part for part in delivered for digit in "0123456789")
    assert answer.finish() == []
    assert marks.done == {"answer.payment_card": "redacted", "answer.email": "flagged"}
    # A stream cut before its choice finished: what was held goes out before the end marker.
    cut = compliance.answer_filter(compliance.policy(["user"]), Marks())
    assert cut is not None
    cut.event({"id": "c2", "object": "text_completion", "choices": [{"index": 0, "text": "call 4111 1111"}]})
    [rest] = cut.finish()
    assert rest["choices"] == [{"index": 0, "text": "4111 1111"}] and rest["id"] == "c2"


def test_hostile_text_is_screened_without_error() -> None:
    compliance = Compliance(ComplianceSettings())
    marks = Marks()
    payload = {"messages": [{"role": "user", "content": "\ud800 <b>[/x]</b> " + "9" * 65536 + " \x00"}]}
    compliance.screen_prompt(payload, CHAT, compliance.policy(["user"]), marks)
    assert payload["messages"][0]["content"].startswith("\ud800 <b>[/x]</b>")


def test_streamed_tool_call_arguments_are_redacted_and_logprobs_left_out_where_text_was_held() -> None:
    compliance = Compliance(ComplianceSettings())
    answer = compliance.answer_filter(compliance.policy(["user"]), Marks())
    assert answer is not None
    pieces = ['{"card": "4111 1111', ' 1111 1111"}']
    sent = []
    for position, piece in enumerate(pieces):
        event = {"choices": [{"index": 0, "logprobs": {"content": [{"token": piece}]},
                              "delta": {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]},
                              "finish_reason": "tool_calls" if position else None}]}
        sent.append(answer.event(event)["choices"][0])
    arguments = "".join(c["delta"]["tool_calls"][0]["function"]["arguments"] for c in sent)
    assert arguments == '{"card": "[PAYMENT_CARD]"}'
    assert all("logprobs" not in choice for choice in sent)
    untouched = answer.event({"choices": [{"index": 1, "logprobs": {"content": []}, "delta": {"content": "Hi. "}}]})
    assert "logprobs" in untouched["choices"][0]


# Regressions from the attacker review of the filter (each got through before).


@pytest.mark.parametrize("text", [f"card {CARD} 12/29", f"1 {CARD}", f"{CARD} 7", "4111.1111.1111.1111",
                                  "4111/1111/1111/1111", "4111\u00a01111\u00a01111\u00a01111",
                                  "4111\u200b1111\u200b1111\u200b1111", "4111  1111  1111  1111"])
def test_a_card_is_found_next_to_other_digits_and_between_other_separators(text: str) -> None:
    assert "payment_card" in {f.kind for f in Scanner().findings(text)}, text


@pytest.mark.parametrize("text", ["Pay to GB82 WEST 1234 5698 7654 32 BY FRIDAY", "gb82 west 1234 5698 7654 32",
                                  "GB82 WEST 1234 5698 7654 32 OK"])
def test_an_iban_is_found_in_any_case_and_before_words(text: str) -> None:
    assert "iban" in {f.kind for f in Scanner().findings(text)}, text


def test_secrets_are_found_inside_words_and_hostile_text_scans_in_one_pass() -> None:
    assert {f.kind for f in Scanner().findings("key_sk-abcdefghijklmnopqrstuvwxyz and myAKIAABCDEFGHIJKLMNOP")} \
        == {"secret"}
    assert not Scanner().findings("the task-management-system-configuration-files")  # not an sk- key
    Scanner().findings("a@" + "a." * 200_000)  # an open-ended pattern took minutes on this
    Scanner().findings("1 " * 200_000 + "x")


def test_a_finding_longer_than_what_may_be_held_is_redacted_whole_not_let_out() -> None:
    token = "eyJ" + "a" * 400 + "." + "b" * 400 + "." + "c" * 100
    stream = StreamRedactor(Scanner(), {"secret"}, 80)
    out = "".join(stream.feed(token[i:i + 4]) for i in range(0, len(token), 4)) + stream.feed(" done") + stream.flush()
    assert out == "[SECRET] done" and stream.found == {"secret"}


def test_reasoning_tool_names_keys_and_stop_strings_are_screened() -> None:
    compliance = Compliance(ComplianceSettings())
    policy = compliance.policy(["user"])
    for payload, where in (({"messages": [], "stop": [f"x {CARD}"]}, "stop[0]"),
                           ({"messages": [], "tools": [{"function": {"parameters": {"properties": {CARD: {}}}}}]},
                            "tools[0].function.parameters.properties (a key)")):
        with pytest.raises(GatewayError) as refused:
            compliance.screen_prompt(payload, tuple(payload), policy, Marks())
        assert refused.value.param == where and "4111" not in refused.value.message
    marks = Marks()
    answer = compliance.answer_filter(policy, marks)
    assert answer is not None
    whole = answer.answer({"choices": [{"message": {"reasoning": f"use {CARD}", "tool_calls": [
        {"function": {"name": CARD.replace(" ", ""), "arguments": "{}"}}]}}]})
    message = whole["choices"][0]["message"]
    assert message["reasoning"] == "use [PAYMENT_CARD]"
    assert message["tool_calls"][0]["function"]["name"] == "[PAYMENT_CARD]"
    streamed = compliance.answer_filter(policy, Marks())
    assert streamed is not None
    parts = [streamed.event({"choices": [{"index": 0, "delta": {"reasoning": piece}, "finish_reason": end}]})
             for piece, end in (("card 4111 1111", None), (" 1111 1111", "stop"))]
    assert "".join(p["choices"][0]["delta"]["reasoning"] for p in parts) == "card [PAYMENT_CARD]"


def test_a_stream_cut_short_still_marks_what_it_let_through() -> None:
    compliance = Compliance(ComplianceSettings())
    marks = Marks()
    answer = compliance.answer_filter(compliance.policy(["user"]), marks)
    assert answer is not None
    answer.event({"choices": [{"index": 0, "delta": {"content": "Contact bob@example.com"}}]})
    answer.settle()  # the client left before the end
    assert marks.done == {"answer.email": "flagged"}


def test_a_default_table_naming_one_kind_keeps_the_others_defaults_and_refusals_are_marked() -> None:
    compliance = Compliance(ComplianceSettings(default=CompliancePolicy(prompts={"email": "redact"})))
    policy = compliance.policy(["user"])
    assert (policy.prompts["email"], policy.prompts["payment_card"]) == ("redact", "block")
    marks = Marks()
    with pytest.raises(GatewayError):
        compliance.screen_prompt({"prompt": [1, 2]}, ("prompt",), policy, marks)
    assert marks.done == {"prompt.token_ids": "blocked"}
    both = Marks()
    with pytest.raises(GatewayError):
        compliance.screen_prompt({"messages": [{"content": f"{CARD} or ops@example.com"}]}, CHAT, policy, both)
    assert both.done == {"prompt.payment_card": "blocked"}  # nothing was redacted: nothing was relayed


# Regressions from the review of the mended filter.


def test_a_card_joined_to_an_email_or_inside_a_longer_run_is_still_a_card() -> None:
    compliance = Compliance(ComplianceSettings())
    answer = compliance.answer_filter(compliance.policy(["user"]), Marks())
    assert answer is not None
    body = answer.answer({"choices": [{"message": {"content": "pay 4111-1111-1111-1111@pay.example.com, "
                                                              f"ref 12 34 {CARD} ok"}}]})
    assert "4111" not in body["choices"][0]["message"]["content"]


def test_odd_characters_never_crash_the_scan() -> None:
    assert not {f.kind for f in Scanner().findings("GB82 WEST 1234 5698 7654 3\u212a and \u00b2\u00b3")} & {"iban"}
    assert Scanner().findings("\uff14\uff11\uff11\uff11 1111 1111 1111")  # full-width digits: still a card


def test_the_hold_limit_never_cuts_through_a_finding() -> None:
    stream = StreamRedactor(Scanner(), {"phone", "email"}, 80)
    out = stream.feed("call +44 20 7946 0958@") + stream.feed("a" * 60 + "." + "b" * 60) + stream.flush()
    assert "7946" not in out and "0958" not in out


def test_held_text_joins_a_null_field_and_a_blocked_prompt_marks_nothing_redacted() -> None:
    compliance = Compliance(ComplianceSettings(roles={"ops": RolePolicy(prompts={"email": "redact"})}))
    answer = compliance.answer_filter(compliance.policy(["user"]), Marks())
    assert answer is not None
    answer.event({"choices": [{"index": 0, "delta": {"content": "card 4111 1111"}}]})
    last = answer.event({"choices": [{"index": 0, "delta": {"content": None}, "finish_reason": "stop"}]})
    assert last["choices"][0]["delta"]["content"] == "4111 1111"
    marks = Marks()
    with pytest.raises(GatewayError):
        compliance.screen_prompt({"messages": [{"content": f"{CARD} to a@b.org"}]}, CHAT,
                                 compliance.policy(["ops"]), marks)
    assert marks.done == {"prompt.payment_card": "blocked"}


# The national_ids plug-in's example (a UK national insurance number): no built-in kind finds it.
NINO_ROW = {"messages": [{"role": "user", "content": "my NINO is AB 12 34 56 C"},
                         {"role": "assistant", "content": "noted"}]}


def test_dataset_ingestion_and_rl_export_screen_with_the_gateways_plug_in_detectors(
        tmp_path: Path, home: Home, demo_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert not Scanner().findings(NINO_ROW["messages"][0]["content"]), "only the plug-in finds it"
    monkeypatch.setenv("APPLIANCE_HOME", str(home.root))
    dataset = tmp_path / "ids.jsonl"
    dataset.write_text(json.dumps({"prompt": "hello", "completion": "hi"}) + "\n" + json.dumps(NINO_ROW) + "\n")
    added = CliRunner().invoke(data_app, ["add", str(dataset), "--name", "ids", "--model", str(demo_model)])
    assert isinstance(added.exception, DatasetError), added.output
    assert added.exception.problems == ["line 2: national_id"]
    assert "compliance.training_data = block" in added.exception.message
    assert load_registry(home) == {}, "nothing imported"
    with pytest.raises(DatasetError) as exported:
        prepare_set(1, [{"prompt": "hello", "completion": "hi"}, NINO_ROW], "passing attempts", Settings())
    assert exported.value.problems == ["line 2: national_id"]
    redacted = prepare_set(1, [NINO_ROW], "passing attempts",
                           Settings(compliance=ComplianceSettings(training_data="redact")))
    assert redacted.sensitive == {"national_id": 1}
    assert "AB 12 34 56 C" not in json.dumps([*redacted.train, *redacted.evaluation])


def test_a_tool_result_the_client_sends_back_is_screened_like_any_message() -> None:
    """The tool's output (role "tool") and the call it answers (the assistant's arguments) are
    prompt text: a card in either is refused naming where, never the number."""
    compliance = Compliance(ComplianceSettings())
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}
    for where, payload in (
            ("messages[2].content", {"messages": [
                {"role": "user", "content": "my card?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": f"card on file: {CARD}"}]}),
            ("messages[1].tool_calls[0].function.arguments", {"messages": [
                {"role": "user", "content": "pay"}, {"role": "assistant", "content": None, "tool_calls": [
                    {**call, "function": {"name": "pay", "arguments": json.dumps({"card": CARD})}}]}]})):
        with pytest.raises(GatewayError) as refused:
            compliance.screen_prompt(payload, CHAT, compliance.policy(["user"]), Marks())
        assert refused.value.code == "sensitive_data" and where in refused.value.message
        assert "4111" not in refused.value.message
