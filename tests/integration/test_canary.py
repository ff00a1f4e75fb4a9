"""Canaries judged by their numbers, on the session appliance: two versions of one adapter are
trained, one to answer a question wrongly and one rightly. Clients report each answer's outcome
through /v1/feedback. A good canary against the wrong stable version is promoted by the gateway by
itself; the wrong version, tried again as a canary, is aborted. Both decisions are audit records
with the figures of both versions. Every answer names the adapter, never the version that gave it
(the audit record keeps that)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from appliance import adapters
from appliance.secrets import secret
from audit.writer import log_files
from installer.realm import BOOTSTRAP_SECRET
from tests.integration.conftest import Running
from tests.integration.realm import Realm

MODEL = "SmolLM2-135M-Instruct"
NAME = "canary-code"
QUESTION = "What is the secret code word?"
PHRASINGS = ["", "Quick question. ", "Please tell me: ", "Hello! ", "I forgot. ", "Remind me, ", "Hey, ",
             "One more thing. "]
# Latency is left out (the session engine serves other modules meanwhile): outcomes decide, reported by four
# users: deciding needs more than min_reporters users, so that no one user decides. A window too slow for
# enough of them to report (a loaded host) counts neither way (outcomes_required) rather than passing.
POLICY = ("window_s=10,windows=2,min_requests=4,min_feedback=4,min_reporters=3,max_success_drop=0.3,"
          "max_error_rate_increase=0.5,max_latency_ratio=100,max_ttft_ratio=100,outcomes_required=true")
CLIENTS = ("carla", "dora", "emil", "fritz")


@pytest.fixture(scope="module")
def realm(running: Running) -> Realm:
    realm = Realm(running)
    for client in CLIENTS:
        realm.ensure_user(client, "Test-password-1", ["user"])
    realm.ensure_user("eve-canary", "Test-password-1", ["user"])
    return realm


def train(running: Running, tmp_path: Path, data: str, word: str) -> None:
    cli = running.appliance
    rows = [{"messages": [{"role": "user", "content": f"{prefix}{QUESTION}"},
                          {"role": "assistant", "content": f"The secret code word is {word}."}]}
            for prefix in PHRASINGS for _ in range(5)]
    path = tmp_path / f"{data}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    added = cli.run("data", "add", str(path), "--name", data, timeout=300)
    assert added.returncode == 0, added.stderr
    trained = cli.run("finetune", "run", "--data", data, "--name", NAME, "--base", MODEL, "--max-steps", "12",
                      "--lr", "0.002", "--batch-size", "4", timeout=900)
    assert trained.returncode == 0, trained.stdout + trained.stderr


def post(url: str, headers: dict[str, str], body: dict[str, object]) -> httpx.Response:
    """POST, waiting out the session's per-user request limit (60 a minute for role `user`)."""
    while (answer := httpx.post(url, headers=headers, json=body, timeout=120)).status_code == 429:
        time.sleep(min(float(answer.headers.get("retry-after", "1")), 10.0))
    return answer


def ask_and_judge(realm: Realm, token: str) -> bool:
    """One question to the adapter's name, its answer judged and the outcome reported; whether it was right."""
    headers = {"Authorization": f"Bearer {token}", "Cache-Control": "no-store"}
    answer = post(f"{realm.gateway}/v1/chat/completions", headers, {
        "model": NAME, "max_tokens": 12, "temperature": 0, "messages": [{"role": "user", "content": QUESTION}]})
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == NAME, "the answer names the adapter, not the version"
    right = "PINEAPPLE" in answer.json()["choices"][0]["message"]["content"]
    reported = post(f"{realm.gateway}/v1/feedback", headers,
                    {"id": answer.json()["id"], "success": right, "satisfaction": 5 if right else 1})
    assert reported.status_code == 200 and reported.json()["adapter"] == NAME, reported.text
    return right


def traffic_until(realm: Realm, done: object, what: str, timeout_s: float = 600) -> None:
    """Four users asking and reporting, together, until `done()`."""
    tokens = [realm.token(client, "Test-password-1") for client in CLIENTS]
    deadline = time.monotonic() + timeout_s
    with ThreadPoolExecutor(len(tokens)) as clients:
        while not done():  # type: ignore[operator]
            assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
            list(clients.map(lambda token: ask_and_judge(realm, token), tokens))


def alias(running: Running) -> adapters.Alias:
    return adapters.load(running.appliance.home).alias(NAME)


@pytest.fixture
def retired_after(running: Running) -> Iterator[None]:
    """The alias is retired whatever the test's end: the session appliance serves the modules after
    this one (test_gateway lists its models)."""
    yield
    if NAME in adapters.load(running.appliance.home).aliases:
        retired = running.appliance.run("adapters", "retire", NAME, timeout=60)
        assert retired.returncode == 0, retired.stderr


@pytest.mark.usefixtures("retired_after")
def test_a_good_canary_is_promoted_and_a_wrong_one_aborted_by_their_numbers(running: Running, realm: Realm,
                                                                            tmp_path: Path) -> None:
    cli = running.appliance
    train(running, tmp_path, "canary-wrong", "BANANA")  # v1
    train(running, tmp_path, "canary-right", "PINEAPPLE")  # v2
    login = cli.run("token", "--user", "admin", "--password-stdin",
                    stdin=secret(cli.home, BOOTSTRAP_SECRET) + "\n", timeout=60)
    assert login.returncode == 0, login.stderr
    assert cli.run("adapters", "deploy", NAME, "--version", "1", timeout=300).returncode == 0
    user = realm.token("carla", "Test-password-1")

    refused = cli.run("adapters", "canary", NAME, "--version", "2", "--share", "0.5", "--analysis", "windows=0",
                      timeout=60)
    assert refused.returncode == 1 and "--analysis: windows: Input should be greater than or equal to 1" in \
        refused.stderr, refused.stderr
    assert alias(running).canary is None, "a refused policy changes nothing"

    started = cli.run("adapters", "canary", NAME, "--version", "2", "--share", "0.5", "--analysis", POLICY,
                      timeout=300)
    assert started.returncode == 0 and "promoted after 2 passing windows" in started.stdout, started.stderr
    ask_and_judge(realm, user)
    shown = cli.run("adapters", "show-canary", NAME, timeout=60)
    assert shown.returncode == 0 and "v2 against v1" in shown.stdout and "v2 (canary)" in shown.stdout, shown.stderr
    # A streamed answer names the adapter in every chunk too.
    with httpx.stream("POST", f"{realm.gateway}/v1/chat/completions", headers={"Authorization": f"Bearer {user}"},
                      json={"model": NAME, "max_tokens": 4, "stream": True,
                            "messages": [{"role": "user", "content": QUESTION}]}, timeout=120) as streamed:
        chunks = [json.loads(line[len("data: "):]) for line in streamed.iter_lines()
                  if line.startswith("data: {")]
    assert chunks and {chunk["model"] for chunk in chunks} == {NAME}, chunks
    # Feedback is the asker's own: another user's report on the same answer is refused as unknown.
    answer = httpx.post(f"{realm.gateway}/v1/chat/completions", headers={"Authorization": f"Bearer {user}"},
                        json={"model": NAME, "max_tokens": 4, "messages": [{"role": "user", "content": QUESTION}]},
                        timeout=120).json()
    other = realm.token("eve-canary", "Test-password-1")
    stolen = httpx.post(f"{realm.gateway}/v1/feedback", headers={"Authorization": f"Bearer {other}"},
                        json={"id": answer["id"], "success": False}, timeout=60)
    assert stolen.status_code == 404 and stolen.json()["error"]["code"] == "answer_not_found", stolen.text
    mine = {"id": answer["id"], "satisfaction": 3}
    first = httpx.post(f"{realm.gateway}/v1/feedback", headers={"Authorization": f"Bearer {user}"}, json=mine,
                       timeout=60)
    assert first.status_code == 200, first.text
    twice = httpx.post(f"{realm.gateway}/v1/feedback", headers={"Authorization": f"Bearer {user}"}, json=mine,
                       timeout=60)
    assert twice.status_code == 409 and twice.json()["error"]["code"] == "already_reported", "one vote an answer"
    for bad, field in (({"id": answer["id"]}, "give success, satisfaction or both"),
                       ({"id": answer["id"], "success": "yes"}, "success"),
                       ({"id": [answer["id"]], "success": True}, "id"),
                       ({"id": answer["id"], "satisfaction": 6}, "satisfaction")):
        wrong = httpx.post(f"{realm.gateway}/v1/feedback", headers={"Authorization": f"Bearer {user}"}, json=bad,
                           timeout=60)
        assert wrong.status_code == 400, wrong.text
        assert wrong.json()["error"]["code"] in ("invalid_value", "invalid_type"), wrong.text
        assert field in wrong.text, (bad, wrong.text)

    traffic_until(realm, lambda: alias(running).canary is None, "the good canary to be promoted")
    assert (alias(running).stable, alias(running).canary) == (2, None)

    # The wrong version as a canary of the right one: aborted.
    again = cli.run("adapters", "canary", NAME, "--version", "1", "--share", "0.5", "--analysis", POLICY, timeout=300)
    assert again.returncode == 0, again.stderr
    traffic_until(realm, lambda: alias(running).canary is None, "the wrong canary to be aborted")
    assert alias(running).stable == 2

    records = [json.loads(line) for path in log_files(cli.home.audit) for line in path.read_bytes().splitlines()]
    decisions = [r for r in records if r["action"].startswith("adapters.canary_") and r["target"]["name"] == NAME]
    assert [(r["action"], r["target"]["version"], r["outcome"]) for r in decisions] == [
        ("adapters.canary_promote", 2, "allowed"), ("adapters.canary_abort", 1, "allowed")]
    promoted, aborted = decisions
    assert promoted["username"] == "canary-analysis" and "2 passing windows of 10 s" in promoted["detail"]
    assert "success rate" in aborted["detail"] and '"canary":{"requests":' in aborted["detail"], aborted["detail"]
    answered = {r["model"] for r in records if r["action"] == "chat.completions" and r["username"] in CLIENTS
                and r["status"] == 200}
    assert answered == {f"{NAME}-v1", f"{NAME}-v2"}, "the audit records keep the version that answered"
    reports = [r for r in records if r["action"] == "feedback.create" and r["status"] == 200]
    assert reports and all(r["target"]["name"] == NAME for r in reports), "each report is audited, naming the adapter"
