"""Every /v1 request through the real gateway leaves a durable, verifiable audit record; an
unwritable log makes the gateway fail closed (issue 4, first part)."""

from __future__ import annotations

import json
import shutil
import time

import httpx
import pytest

from appliance.supervisor import Supervisor
from audit.writer import log_files
from tests.integration.conftest import Running
from tests.integration.realm import Realm

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def realm(running: Running) -> Realm:
    realm = Realm(running)
    realm.ensure_user("ivan", "Test-password-1", ["user"])
    return realm


def records(running: Running) -> list[dict]:
    return [json.loads(line) for path in log_files(running.appliance.home.audit)
            for line in path.read_bytes().splitlines()]


def test_allowed_and_denied_requests_are_recorded(realm: Realm, running: Running) -> None:
    token = realm.token("ivan", "Test-password-1")
    chat = httpx.post(f"{realm.gateway}/v1/chat/completions", headers={"Authorization": f"Bearer {token}"},
                      json={"model": MODEL, "max_tokens": 8, "temperature": 0,
                            "messages": [{"role": "user", "content": "secret prompt 42"}]}, timeout=120)
    assert chat.status_code == 200
    streamed = httpx.post(f"{realm.gateway}/v1/chat/completions", headers={"Authorization": f"Bearer {token}"},
                          json={"model": MODEL, "max_tokens": 8, "stream": True,
                                "messages": [{"role": "user", "content": "Hi"}]}, timeout=120)
    assert streamed.status_code == 200
    denied = httpx.get(f"{realm.gateway}/v1/models")
    assert denied.status_code == 401

    by_id = {r["request_id"]: r for r in records(running)}
    record = by_id[chat.headers["x-request-id"]]
    assert record["action"] == "chat.completions" and record["outcome"] == "allowed"
    assert record["username"] == "ivan" and record["client"] == "appliance-cli"
    assert record["source"] == "127.0.0.1" and record["resource"] == MODEL and record["status"] == 200
    assert record["prompt_tokens"] > 0 and record["completion_tokens"] > 0
    assert len(record["prompt_hmac"]) == 64 and len(record["completion_hmac"]) == 64
    assert record["prompt"] is None and record["completion"] is None, "raw text only when capture is on"
    assert "secret prompt 42" not in json.dumps(records(running))
    stream_record = by_id[streamed.headers["x-request-id"]]
    assert stream_record["completion_tokens"] > 0 and stream_record["completion_hmac"]
    denial = by_id[denied.headers["x-request-id"]]
    assert denial["action"] == "auth.denied" and denial["outcome"] == "denied" and denial["status"] == 401

    verified = running.appliance.run("audit", "verify", timeout=60)
    assert verified.returncode == 0 and "audit log OK" in verified.stdout, verified.stderr
    exported = running.appliance.run("audit", "export", "--user", "ivan", "--format", "csv", timeout=60)
    assert exported.stdout.splitlines()[0].startswith("seq,time,request_id")
    assert len(exported.stdout.splitlines()) == 3


def test_unwritable_log_fails_closed_and_readyz_says_why(realm: Realm, running: Running) -> None:
    home = running.appliance.home
    current = log_files(home.audit)[-1]
    moved = current.with_suffix(".moved")
    current.rename(moved)
    current.mkdir()  # the writer's file is now a directory: every write fails, even as root
    token = realm.token("ivan", "Test-password-1")
    try:
        refused = httpx.post(f"{realm.gateway}/v1/chat/completions", headers={"Authorization": f"Bearer {token}"},
                             json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]},
                             timeout=120)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "audit_unavailable"
        again = httpx.get(f"{realm.gateway}/v1/models", headers={"Authorization": f"Bearer {token}"})
        assert again.status_code == 503
        ready = httpx.get(f"{realm.gateway}/readyz")
        assert ready.status_code == 503 and ready.json()["checks"]["audit"] is False
        assert "not writable" in ready.json()["reason"]
    finally:
        current.rmdir()
        moved.rename(current)
        supervisor = Supervisor(home)
        supervisor.call("stopProcess", "gateway", True)
        supervisor.call("startProcess", "gateway", True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{realm.gateway}/readyz").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    assert httpx.get(f"{realm.gateway}/v1/models", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    assert running.appliance.run("audit", "verify", timeout=60).returncode == 0
