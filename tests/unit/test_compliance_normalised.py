"""Regressions from the attacker review of the compliance filter: cards, IBANs and keys written in
ordinary ways (commas, line breaks, tabs, dashes, bullets, invisible characters between their
digits, a card after short digit groups, digits of other scripts, a key split by a space) and
numbers sent as JSON numbers, in prompts and in answers (whole, streamed, several choices)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from appliance.sensitive import Scanner, scanner_from
from appliance.settings import ComplianceSettings, RolePolicy
from serve.compliance import Compliance, Marks
from serve.errors import GatewayError

CARD = "4111 1111 1111 1111"
CARDS = {"commas": "4111,1111,1111,1111", "comma spaces": "4111, 1111, 1111, 1111",
         "newlines": "4111\n1111\n1111\n1111",
         "tabs": "4111\t1111\t1111\t1111", "en dashes": "4111\u20131111\u20131111\u20131111",
         "spaced dashes": "4111 - 1111 - 1111 - 1111", "bullets": "4111 \u2022 1111 \u2022 1111 \u2022 1111",
         "colons": "4111:1111:1111:1111", "zero-width joiners": "4111\u200d1111\u200d1111\u200d1111",
         "word joiners": "4111\u20601111\u20601111\u20601111", "soft hyphens": "4111\u00ad1111\u00ad1111\u00ad1111",
         "after short groups": "12 34 56 4111 1111 1111 1111", "one by one": "4 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1",
         "arabic-indic": "\u0664\u0661\u0661\u0661 \u0661\u0661\u0661\u0661 \u0661\u0661\u0661\u0661 "
                         "\u0661\u0661\u0661\u0661",
         "devanagari and full-width": "\u096a\u0967\u0967\u0967-\uff11\uff11\uff11\uff11-1111-1111",
         "paragraphs": "4111 1111\r\n\r\n1111 1111",
         # As JSON text writes them (a tool call's arguments): whoever parses it reads the card.
         "json line breaks": "4111\\n1111\\n1111\\n1111", "json escapes": "\\u0034111\\u20131111\\u2013111\\u00311111",
         # Separators Unicode classes as letters (Lm), and other scripts' letters in a short gap.
         "katakana prolonged sound marks": "4111\u30fc1111\u30fc1111\u30fc1111",
         "modifier letter primes": "4111\u02b91111\u02b91111\u02b91111",
         "halfwidth katakana marks": "4111" + "\uff701111" * 3, "cjk characters": "4111\u4e2d1111\u4e2d1111\u4e2d1111",
         "greek and spaces": "4111 \u03b1 1111 \u03b1 1111 \u03b1 1111"}
IBANS = {"commas": "GB82,WEST,1234,5698,7654,32", "full-width code": "\uff27\uff22\uff18\uff12 WEST 1234 5698 7654 32",
         "lower case, dashes": "gb82-west-1234-5698-7654-32", "new lines": "DE89\n3704\n0044\n0532\n0130\n00",
         "katakana prolonged sound marks": "DE89\u30fc3704\u30fc0044\u30fc0532\u30fc0130\u30fc00",
         "modifier letters": "GB82\u02b9WEST\u02b91234\u02b95698\u02b97654\u02b932"}
SECRETS = {"sk- with a zero-width space": "sk-abcdefgh\u200bijklmnopqrstuvwxyz12",
           "AKIA with a space": "AKIA ABCDEFGHIJKLMNOP", "AKIA with a line break": "AKIAABCDEFGH\nIJKLMNOP",
           "ghp_ with a word joiner": "ghp_" + "a1" * 9 + "\u2060" + "b2" * 9,
           "sk - split by spaces": "sk - abcdefghijklmnopqrstuvwxyz12",
           "AKI A split by a space": "AKI AABCDEFGHIJKLMNOP",
           "AKIA split by a line break": "AK\nIAABCDEFGHIJKLMNOP",
           # Other providers' shapes, from the vendored rules.
           "aws temporary": "ASIAQWERTYUIOPASDFGH", "stripe live": "sk_live_4eC39HqLyjWDarjtT1zdp7dc",
           "gitlab": "glpat-Ab3dEf7hIj1lMn0pQr5t", "hugging face": "hf_AbcdEfghIjklMnopQrstUvwxYzabCdefGh",
           "google": "AIzaSyA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q", "gitlab split": "gl pat-Ab3dEf7hIj1lMn0pQr5t",
           "pem private key": "-----BEGIN EC PRIVATE KEY-----\n" + "MHcCAQEEIBkg4LVWM9nuwNSk3yByxZpYRTBnVJk5" * 2
                              + "\n-----END EC PRIVATE KEY-----"}


@pytest.mark.parametrize(("name", "written"), list(CARDS.items()), ids=list(CARDS))
def test_a_card_however_separated_is_found_and_redacted_whole(name: str, written: str) -> None:
    text = f"pay with {written} today"
    kept = "12 34 56 " if name == "after short groups" else ""  # not part of the card
    assert Scanner().redact(text) == f"pay with {kept}[PAYMENT_CARD] today"


@pytest.mark.parametrize("written", list(IBANS.values()), ids=list(IBANS))
def test_an_iban_however_written_is_an_iban(written: str) -> None:
    text = f"send it to {written}, thanks"
    assert Scanner().redact(text) == "send it to [IBAN], thanks"


@pytest.mark.parametrize("written", list(SECRETS.values()), ids=list(SECRETS))
def test_a_key_split_by_a_space_or_an_invisible_character_is_a_secret(written: str) -> None:
    assert Scanner().redact(f"key: {written} end") == "key: [SECRET] end"


def test_what_is_not_a_card_stays_and_redaction_changes_only_the_finding() -> None:
    assert not Scanner().findings("order 4111 1111 1111 1112, lines 1, 2, 3 and 4")
    assert not Scanner().findings("12345678901234567890123")  # one number too long for a card
    text = "\u200bcard:\u20604111\u200b1111\u200b1111\u200b1111\u2060."
    assert Scanner().redact(text) == "\u200bcard:\u2060[PAYMENT_CARD]\u2060."
    assert Scanner().redact("\ufb01 4111-1111-1111-1111 \ufb01") == "\ufb01 [PAYMENT_CARD] \ufb01"


def test_one_factory_builds_the_scanner_of_patterns_and_plug_ins() -> None:
    scanner = scanner_from(ComplianceSettings(patterns={"employee_id": r"E-\d{6}"}, detectors=["national_ids"]))
    assert {"employee_id", "national_id", "payment_card"} <= scanner.kinds
    assert scanner.redact("E\u2013123456 and 123\u201345\u20136789") == "[EMPLOYEE_ID] and [NATIONAL_ID]"


def refused(compliance: Compliance, payload: dict[str, Any]) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        compliance.screen_prompt(payload, tuple(name for name in payload if name != "model"),
                                 compliance.policy(["user"]), Marks())
    return caught.value


@pytest.mark.parametrize("number", [4111111111111111, 4111111111111111.0, 5500000000000004])
def test_a_card_sent_as_a_json_number_anywhere_is_refused(number: float) -> None:
    compliance = Compliance(ComplianceSettings())
    for payload, where in (
            ({"messages": [], "chat_template_kwargs": {"account": number}}, "chat_template_kwargs.account"),
            ({"messages": [], "response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"properties": {"card": {"const": number}}}}}},
             "response_format.json_schema.schema.properties.card.const"),
            ({"messages": [], "tools": [{"type": "function", "function": {"name": "pay", "parameters": {
                "properties": {"card": {"enum": [1, number]}}}}}]},
             "tools[0].function.parameters.properties.card.enum[1]")):
        error = refused(compliance, json.loads(json.dumps(payload)))
        assert (error.code, error.param) == ("sensitive_data", where)
        assert "4111" not in error.message and "5500" not in error.message


def test_a_card_number_is_redacted_to_a_string_and_other_numbers_are_left_alone() -> None:
    compliance = Compliance(ComplianceSettings(roles={"ops": RolePolicy(prompts={"payment_card": "redact"})}))
    marks = Marks()
    payload: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.7, "max_tokens": 64,
                               "chat_template_kwargs": {"card": 4111111111111111, "on": True, "n": 12}}
    compliance.screen_prompt(payload, ("messages", "temperature", "max_tokens", "chat_template_kwargs"),
                             compliance.policy(["ops"]), marks)
    assert payload["chat_template_kwargs"] == {"card": "[PAYMENT_CARD]", "on": True, "n": 12}
    assert (payload["temperature"], payload["max_tokens"]) == (0.7, 64)
    assert marks.done == {"prompt.payment_card": "redacted"}


@pytest.mark.parametrize("written", [CARDS[k] for k in ("commas", "newlines", "en dashes", "zero-width joiners",
                                                          "after short groups", "bullets")])
def test_a_separated_card_in_a_prompt_is_refused(written: str) -> None:
    error = refused(Compliance(ComplianceSettings()), {"messages": [{"role": "user", "content": f"card {written}"}]})
    assert (error.code, error.param) == ("sensitive_data", "messages[0].content")


ANSWERED = [CARDS[k] for k in ("commas", "newlines", "colons", "en dashes")]


def test_every_choice_of_a_whole_answer_is_redacted_and_loses_its_logprobs() -> None:
    compliance = Compliance(ComplianceSettings())
    marks = Marks()
    answer = compliance.answer_filter(compliance.policy(["user"]), marks)
    assert answer is not None
    choices = [{"index": i, "logprobs": {"content": []}, "message": {"content": f"it is {card}"}}
               for i, card in enumerate(ANSWERED)]
    choices.append({"index": 9, "logprobs": {"content": []},
                    "message": {"content": "IBAN GB82,WEST,1234,5698,7654,32", "tool_calls": [
                        {"function": {"name": "pay", "arguments": json.dumps({"card": CARDS["en dashes"]})}}]}})
    body = answer.answer({"choices": choices})
    assert [c["message"]["content"] for c in body["choices"]] == ["it is [PAYMENT_CARD]"] * 4 + ["IBAN [IBAN]"]
    assert body["choices"][4]["message"]["tool_calls"][0]["function"]["arguments"] == '{"card": "[PAYMENT_CARD]"}'
    assert all("logprobs" not in c for c in body["choices"])
    assert marks.done == {"answer.payment_card": "redacted", "answer.iban": "redacted"}


def test_every_choice_of_a_streamed_answer_is_redacted_whole_however_it_is_cut() -> None:
    compliance = Compliance(ComplianceSettings())
    answer = compliance.answer_filter(compliance.policy(["user"]), Marks())
    assert answer is not None
    texts = {i: f"card {card} ok" for i, card in enumerate(ANSWERED)}
    sent: dict[int, str] = dict.fromkeys(texts, "")
    for at in range(0, 40, 3):
        for index, text in texts.items():
            end = at + 3 >= len(text)
            event = {"choices": [{"index": index, "delta": {"content": text[at:at + 3]}, "logprobs": {"content": []},
                                  "finish_reason": "stop" if end else None}]}
            choice = answer.event(event)["choices"][0]
            sent[index] += choice["delta"].get("content") or ""
    assert set(sent.values()) == {"card [PAYMENT_CARD] ok"}


def test_streamed_tool_call_arguments_with_json_escapes_are_redacted_wherever_they_are_cut() -> None:
    compliance = Compliance(ComplianceSettings())
    arguments = json.dumps({"card": "4111\u20131111\n1111\u00a01111", "note": "ok"})
    whole = '{"card": "[PAYMENT_CARD]", "note": "ok"}'
    for cut in range(1, len(arguments)):
        answer = compliance.answer_filter(compliance.policy(["user"]), Marks())
        assert answer is not None
        sent = ""
        for position, piece in enumerate((arguments[:cut], arguments[cut:])):
            event = {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]},
                                  "finish_reason": "tool_calls" if position else None}]}
            sent += answer.event(event)["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]
        assert sent == whole, cut
