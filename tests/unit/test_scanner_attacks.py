"""Classes an attacker found in the normalising scanner, one test each: an escape cut by a
stream's piece, digits that are digits only to a reader, surrogate-pair escapes, minus signs and
further key prefixes, a finding of a kind the policy ignores hiding one it acts on, values nested
deep enough to crash or slow screening, and separators Unicode classes as letters, key prefixes
split by spaces and other providers' key shapes (prompts, whole answers, streams)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from appliance.sensitive import Scanner
from appliance.settings import ComplianceSettings, RolePolicy
from serve.compliance import DESCRIBED, Compliance, Marks
from serve.errors import GatewayError
from serve.schemas import MAX_NESTING, ChatRequest

SCANNER = Scanner()
COMPLIANCE = Compliance(ComplianceSettings())
POLICY = COMPLIANCE.policy(["user"])


def streamed_arguments(arguments: str) -> str:
    """A tool call's arguments as the client gets them, streamed a character an event."""
    answer = COMPLIANCE.answer_filter(POLICY, Marks())
    assert answer is not None
    sent = ""
    for position, char in enumerate(arguments):
        event = {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": char}}]},
                              "finish_reason": "tool_calls" if position == len(arguments) - 1 else None}]}
        sent += answer.event(event)["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]
    return sent


@pytest.mark.parametrize(("value", "kind"), [
    ("\\u0034111 1111 1111 1111", "PAYMENT_CARD"), ("\\u0073k-abcdefghijklmnopqrstuvwxyz123", "SECRET"),
    ("\\u0047B82 WEST 1234 5698 7654 32", "IBAN"), ("\\u0041KIAABCDEFGHIJKLMNOP", "SECRET"),
    (json.dumps("𝟒𝟏𝟏𝟏 𝟏𝟏𝟏𝟏 𝟏𝟏𝟏𝟏 𝟏𝟏𝟏𝟏")[1:-1], "PAYMENT_CARD")])
def test_an_escape_cut_by_a_streamed_piece_hides_nothing(value: str, kind: str) -> None:
    arguments = f'{{"x": "{value}"}}'
    assert json.loads(streamed_arguments(arguments)) == {"x": f"[{kind}]"}


def test_an_escape_cut_by_a_piece_is_not_read_as_digits() -> None:
    """The hex digits of an escape are not a card's: a stream says what the whole text says."""
    text = "\\u00e9\\u00e9 7393 1851 1056 5403 ok"
    assert streamed_arguments(text) == SCANNER.redact(text) == text


@pytest.mark.parametrize("text", ["pay ❹❶❶❶ ❶❶❶❶ ❶❶❶❶ ❶❶❶❶", "፬፩፩፩ ፩፩፩፩ ፩፩፩፩ ፩፩፩፩", "➃➀➀➀ ➀➀➀➀ ➀➀➀➀ ➀➀➀➀"])
def test_digits_that_are_digits_only_to_a_reader_are_read(text: str) -> None:
    assert SCANNER.redact(text).endswith("[PAYMENT_CARD]")


@pytest.mark.parametrize("key", ["sk\u2212abcdefghijklmnopqrstuvwxyz", "github_pat_11ABCDEFG0123456789abcdef_xyz",
                                 "xoxe-1234567890abc", "xoxs-1234567890abc"])
def test_further_key_shapes_are_secrets(key: str) -> None:
    assert SCANNER.redact(f"key {key} end") == "key [SECRET] end"


@pytest.mark.parametrize("text", ["DE 4111 1111 1111 1111 {}", "fi 5500-0000-0000-0004 {}"])
def test_a_kind_the_policy_ignores_never_hides_one_it_acts_on(text: str) -> None:
    """Two digits after a card make some IBAN valid: asked for cards only, the card is found."""
    for tail in range(100):
        candidate = text.format(f"{tail:02d}")
        assert [f.kind for f in SCANNER.findings(candidate, {"payment_card"})] == ["payment_card"], candidate


def nested(depth: int) -> object:
    return json.loads("[" * (depth - 1) + '"4111 1111 1111 1111"' + "]" * (depth - 1))


def test_a_field_nested_past_the_limit_is_refused_naming_it() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    ChatRequest.model_validate({**body, "chat_template_kwargs": {"a": nested(MAX_NESTING - 1)}})
    with pytest.raises(ValidationError) as refused:
        ChatRequest.model_validate({**body, "chat_template_kwargs": {"a": nested(500)}})
    assert refused.value.errors()[0]["loc"] == ("chat_template_kwargs",)


def test_the_deepest_value_allowed_is_screened_and_redacted() -> None:
    compliance = Compliance(ComplianceSettings(roles={"auditor": RolePolicy(prompts={"payment_card": "redact"})}))
    payload = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"a": nested(MAX_NESTING - 1)}}
    marks = Marks()
    compliance.screen_prompt(payload, ("messages", "chat_template_kwargs"), compliance.policy(["auditor"]), marks)
    assert "[PAYMENT_CARD]" in json.dumps(payload) and "4111" not in json.dumps(payload)


def test_a_flagged_finding_never_hides_a_stricter_one_it_overlaps() -> None:
    """Ranked by action: what a policy blocks or redacts is found before what it only flags."""
    settings = ComplianceSettings(patterns={"employee_id": r"EMP-\d{16}"},
                                  roles={"hr": RolePolicy(prompts={"payment_card": "flag", "employee_id": "block"},
                                                          answers={"payment_card": "flag", "email": "redact"})})
    compliance = Compliance(settings)
    policy = compliance.policy(["hr"])
    payload = {"messages": [{"role": "user", "content": "id EMP-4111111111111111"}]}
    with pytest.raises(GatewayError) as refused:
        compliance.screen_prompt(payload, ("messages",), policy, Marks())
    assert refused.value.code == "sensitive_data"
    answer = compliance.answer_filter(policy, Marks())
    assert answer is not None
    body = answer.answer({"choices": [{"message": {"content": "mail 4111111111111111@corp.example.com"}}]})
    assert body["choices"][0]["message"]["content"] == "mail [EMAIL]"


# Each class the look-alike letters review found, in prompts, whole answers and streamed answers.
LOOK_ALIKES = {
    "katakana prolonged sound mark": ("payment_card", "4111\u30fc1111\u30fc1111\u30fc1111"),
    "modifier letter apostrophe": ("payment_card", "4111\u02bc1111\u02bc1111\u02bc1111"),
    "iban with modifier letters": ("iban", "GB82\u02b9WEST\u02b91234\u02b95698\u02b97654\u02b932"),
    "sk - with spaces": ("secret", "sk - abcdefghijklmnopqrstuvwxyz12"),
    "AKI A with a space": ("secret", "AKI AABCDEFGHIJKLMNOP"),
    "aws temporary key": ("secret", "ASIAQWERTYUIOPASDFGH"),
    "stripe live key": ("secret", "sk_live_4eC39HqLyjWDarjtT1zdp7dc"),
    "gitlab token": ("secret", "glpat-Ab3dEf7hIj1lMn0pQr5t"),
    "hugging face token": ("secret", "hf_AbcdEfghIjklMnopQrstUvwxYzabCdefGh"),
    "google api key": ("secret", "AIzaSyA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q"),
    "pem private key": ("secret", "-----BEGIN PRIVATE KEY-----\n" + "MIIEvQIBADANBgkqhkiG9w0BAQEFAASC" * 3
                        + "\n-----END PRIVATE KEY-----"),
}


@pytest.mark.parametrize(("kind", "written"), list(LOOK_ALIKES.values()), ids=list(LOOK_ALIKES))
def test_look_alike_separators_split_prefixes_and_other_providers_keys_are_caught(kind: str, written: str) -> None:
    text = f"here: {written} thanks"
    with pytest.raises(GatewayError) as refused:
        COMPLIANCE.screen_prompt({"messages": [{"role": "user", "content": text}]}, ("messages",), POLICY, Marks())
    assert refused.value.code == "sensitive_data" and DESCRIBED[kind] in refused.value.message
    answer = COMPLIANCE.answer_filter(POLICY, Marks())
    assert answer is not None
    whole = answer.answer({"choices": [{"message": {"content": text}}]})["choices"][0]["message"]["content"]
    stream = COMPLIANCE.answer_filter(POLICY, Marks())
    assert stream is not None
    streamed = "".join(stream.event({"choices": [{"index": 0, "delta": {"content": char},
                                                  "finish_reason": "stop" if at == len(text) - 1 else None}]})
                       ["choices"][0]["delta"]["content"] for at, char in enumerate(text))
    assert whole == streamed == f"here: [{kind.upper()}] thanks"
