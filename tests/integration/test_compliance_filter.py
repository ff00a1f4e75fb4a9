"""Live compliance filtering through the real gateway, Keycloak and vLLM: a prompt holding
a card number is refused naming the kind, one holding an e-mail address goes through flagged, an
answer's card number is redacted whole though the engine streams it token by token, and a role
whose policy redacts prompts has the engine see the redacted prompt. Each request's audit record
says what the filter did, never the text. The gateway is started again first, so that it runs this
checkout's scanner (the session appliance may have started before it changed)."""

from __future__ import annotations

import json

import httpx
import pytest

from audit.writer import log_files
from tests.integration.conftest import Running
from tests.integration.realm import Realm
from tests.integration.test_alerts_firing import restart_program

pytestmark = pytest.mark.session_exclusive  # it starts the gateway again

MODEL = "SmolLM2-135M-Instruct"
PASSWORD = "Test-password-1"
CARD = "4111 1111 1111 1111"
FORCED = f"Card {CARD} ok"  # the answer the engine is made to give (structured output), token by token
# The regex that forces it must not hold the card itself: the prompt's screening reads "4111[ ]1111..." as one.
FORCING = "Card 4111([ ]1111){3}[ ]ok"


@pytest.fixture(scope="module")
def realm(running: Running) -> Realm:
    restart_program(running, "gateway")
    realm = Realm(running)
    realm.ensure_user("compliance-user", PASSWORD, ["user"])
    realm.ensure_user("compliance-admin", PASSWORD, ["admin"])  # compliance.roles.admin (session settings)
    return realm


def ask(realm: Realm, user: str, path: str, body: dict) -> httpx.Response:
    token = realm.token(user, PASSWORD)
    return httpx.post(f"{realm.gateway}{path}", json={"model": MODEL, **body}, timeout=300,
                      headers={"Authorization": f"Bearer {token}"})


def record_of(running: Running, request_id: str) -> dict:
    for path in log_files(running.appliance.home.audit):
        for line in path.read_bytes().splitlines():
            record = json.loads(line)
            if record.get("request_id") == request_id:
                return record
    raise AssertionError(f"no audit record of {request_id}")


def test_a_card_in_a_prompt_is_refused_naming_the_kind_never_the_number(realm: Realm, running: Running) -> None:
    refused = ask(realm, "compliance-user", "/v1/chat/completions",
                  {"messages": [{"role": "user", "content": f"Charge my card {CARD} please"}], "max_tokens": 4})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "sensitive_data" and error["param"] == "messages[0].content"
    assert "a payment card number" in error["message"] and "4111" not in refused.text
    record = record_of(running, refused.headers["x-request-id"])
    assert record["sensitive"] == {"prompt.payment_card": "blocked"} and "4111" not in json.dumps(record)


def test_an_email_in_a_prompt_goes_through_flagged(realm: Realm, running: Running) -> None:
    answered = ask(realm, "compliance-user", "/v1/chat/completions",
                   {"messages": [{"role": "user", "content": "Write to ops@example.com"}], "max_tokens": 4})
    assert answered.status_code == 200, answered.text
    assert record_of(running, answered.headers["x-request-id"])["sensitive"] == {"prompt.email": "flagged"}


@pytest.mark.parametrize("stream", [True, False])
def test_a_card_in_an_answer_is_redacted_whole_even_streamed_token_by_token(realm: Realm, running: Running,
                                                                             stream: bool) -> None:
    body = {"messages": [{"role": "user", "content": "Say it."}], "max_tokens": 32, "temperature": 0,
            "structured_outputs": {"regex": FORCING}, "stream": stream}
    answered = ask(realm, "compliance-user", "/v1/chat/completions", body)
    assert answered.status_code == 200, answered.text
    assert "4111" not in answered.text
    if stream:
        events = [json.loads(line[len("data: "):]) for line in answered.text.splitlines()
                  if line.startswith("data: {")]
        pieces = [e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices")]
        text = "".join(pieces)
        assert sum(bool(p) for p in pieces) >= 3, "the engine streamed it in pieces"
    else:
        text = answered.json()["choices"][0]["message"]["content"]
    assert text == "Card [PAYMENT_CARD] ok"
    assert record_of(running, answered.headers["x-request-id"])["sensitive"] == {"answer.payment_card": "redacted"}


def test_a_redacting_role_has_the_engine_see_the_redacted_prompt(realm: Realm, running: Running) -> None:
    answered = ask(realm, "compliance-admin", "/v1/completions",
                   {"prompt": f"My card is {CARD}.", "max_tokens": 1, "echo": True, "temperature": 0})
    assert answered.status_code == 200, answered.text
    assert answered.json()["choices"][0]["text"].startswith("My card is [PAYMENT_CARD].")  # as the engine saw it
    assert record_of(running, answered.headers["x-request-id"])["sensitive"] == {"prompt.payment_card": "redacted"}
    ids = ask(realm, "compliance-user", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1})
    assert ids.status_code == 400 and ids.json()["error"]["param"] == "prompt"


# Regressions from the attacker review: sensitive data written in ordinary ways is refused too (the
# default policy blocks cards, IBANs and keys in prompts), a card sent as a JSON number included.
WRITTEN = {"commas": ("payment_card", "4111,1111,1111,1111"), "newlines": ("payment_card", "4111\n1111\n1111\n1111"),
           "en dashes": ("payment_card", "4111\u20131111\u20131111\u20131111"),
           "zero-width joiners": ("payment_card", "4111\u200d1111\u200d1111\u200d1111"),
           "after short groups": ("payment_card", "12 34 56 4111 1111 1111 1111"),
           "iban with commas": ("iban", "GB82,WEST,1234,5698,7654,32"),
           "iban with a full-width code": ("iban", "\uff27\uff22\uff18\uff12 WEST 1234 5698 7654 32"),
           "sk- key with a zero-width space": ("secret", "sk-abcdefgh\u200bijklmnopqrstuvwxyz12"),
           "AKIA key with a space": ("secret", "AKIA ABCDEFGHIJKLMNOP"),
           # Separators Unicode classes as letters; key prefixes split by spaces; the vendored rules.
           "katakana prolonged sound marks": ("payment_card", "4111\u30fc1111\u30fc1111\u30fc1111"),
           "modifier letter primes": ("payment_card", "4111\u02b91111\u02b91111\u02b91111"),
           "iban with katakana marks": ("iban", "GB82\u30fcWEST\u30fc1234\u30fc5698\u30fc7654\u30fc32"),
           "sk - split prefix": ("secret", "sk - abcdefghijklmnopqrstuvwxyz12"),
           "AKI A split prefix": ("secret", "AKI AABCDEFGHIJKLMNOP"),
           "aws temporary key": ("secret", "ASIAQWERTYUIOPASDFGH"),
           "stripe live key": ("secret", "sk_live_4eC39HqLyjWDarjtT1zdp7dc"),
           "gitlab token": ("secret", "glpat-Ab3dEf7hIj1lMn0pQr5t"),
           "hugging face token": ("secret", "hf_AbcdEfghIjklMnopQrstUvwxYzabCdefGh"),
           "google api key": ("secret", "AIzaSyA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q"),
           "pem private key": ("secret", "-----BEGIN PRIVATE KEY-----\n" + "MIIEvQIBADANBgkqhkiG9w0BAQEFAASC" * 4
                               + "\n-----END PRIVATE KEY-----")}
# What none of the above may leave in a refusal: a piece of each.
NEVER_SHOWN = ("4111", "WEST", "ABCDEFGH", "QWERTYUIOP", "4eC39Hq", "Ab3dEf7h", "AbcdEfgh", "A1b2C3d4", "MIIEvQ")


def test_sensitive_data_however_written_is_refused_and_a_card_as_a_number_too(realm: Realm, running: Running) -> None:
    token = realm.token("compliance-user", PASSWORD)
    with httpx.Client(base_url=realm.gateway, timeout=60, headers={"Authorization": f"Bearer {token}"}) as client:
        for name, (kind, written) in WRITTEN.items():
            refused = client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": f"Use {written} now"}], "max_tokens": 4})
            assert refused.status_code == 400, (name, refused.text)
            error = refused.json()["error"]
            assert (error["code"], error["param"]) == ("sensitive_data", "messages[0].content"), name
            assert not [piece for piece in NEVER_SHOWN if piece in refused.text], name
            assert record_of(running, refused.headers["x-request-id"])["sensitive"] == {f"prompt.{kind}": "blocked"}
        number = client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "chat_template_kwargs": {"account": 4111111111111111}})
        assert number.status_code == 400, number.text
        assert number.json()["error"]["param"] == "chat_template_kwargs.account" and "4111" not in number.text


# Answers the engine is made to give (structured output), token by token: a card parted by katakana
# prolonged sound marks and a GitLab token (a vendored rule's shape). The regexes that force them
# hold neither as the prompt's screening reads them.
FORCED_ANSWERS = {"katakana card": ("Card 4111(\u30fc1111){3} ok", "Card [PAYMENT_CARD] ok", "payment_card"),
                  "gitlab token": ("Key gl(p)at-Ab3dEf7hIj1lMn0pQr5t ok", "Key [SECRET] ok", "secret")}


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("case", list(FORCED_ANSWERS), ids=list(FORCED_ANSWERS))
def test_new_classes_in_an_answer_are_redacted_even_streamed_token_by_token(realm: Realm, running: Running,
                                                                            case: str, stream: bool) -> None:
    forcing, expected, kind = FORCED_ANSWERS[case]
    body = {"messages": [{"role": "user", "content": "Say it."}], "max_tokens": 48, "temperature": 0,
            "structured_outputs": {"regex": forcing}, "stream": stream}
    answered = ask(realm, "compliance-user", "/v1/chat/completions", body)
    assert answered.status_code == 200, answered.text
    assert "1111" not in answered.text and "Ab3dEf7h" not in answered.text
    if stream:
        events = [json.loads(line[len("data: "):]) for line in answered.text.splitlines()
                  if line.startswith("data: {")]
        pieces = [e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices")]
        assert sum(bool(p) for p in pieces) >= 3, "the engine streamed it in pieces"
        text = "".join(pieces)
    else:
        text = answered.json()["choices"][0]["message"]["content"]
    assert text == expected
    assert record_of(running, answered.headers["x-request-id"])["sensitive"] == {f"answer.{kind}": "redacted"}
