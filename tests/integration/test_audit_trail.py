"""Every /v1 request through the real gateway leaves a durable, verifiable audit record; an
unwritable log makes the gateway fail closed (issue 4, first part)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from appliance.errors import SupervisorError
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

    realm.ensure_user("judy", "Test-password-1", ["auditor"])
    auditor = {"Authorization": f"Bearer {realm.token('judy', 'Test-password-1')}"}
    queried = httpx.get(f"{realm.gateway}/admin/audit", params={"user": "ivan"}, headers=auditor)
    assert queried.status_code == 200 and [r["username"] for r in queried.json()] == ["ivan", "ivan"]
    as_user = httpx.get(f"{realm.gateway}/admin/audit", headers={"Authorization": f"Bearer {token}"})
    assert as_user.status_code == 403


def test_admin_changes_are_recorded(realm: Realm, running: Running) -> None:
    admin = {"Authorization": f"Bearer {realm.admin_token()}"}
    added = httpx.post(f"{realm.gateway}/admin/users", headers=admin, timeout=60,
                       json={"username": "kate", "roles": ["user"]})
    assert added.status_code == 201
    disabled = httpx.post(f"{realm.gateway}/admin/users/kate/disable", headers=admin, timeout=60)
    assert disabled.status_code == 200
    by_id = {r["request_id"]: r for r in records(running)}
    add = by_id[added.headers["x-request-id"]]
    assert (add["action"], add["username"], add["outcome"], add["status"]) == ("users.add", "admin", "allowed", 201)
    disable = by_id[disabled.headers["x-request-id"]]
    assert (disable["action"], disable["resource"]) == ("users.disable", "kate")


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
        try:
            supervisor.call("startProcess", "gateway", True)
        except SupervisorError as exc:
            raise AssertionError(f"{exc}\n{(home.logs / 'gateway.log').read_text()[-4000:]}") from exc
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{realm.gateway}/readyz").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    log = (home.logs / "gateway.log").read_text()[-3000:]
    state = running.appliance.run("status").stdout
    assert httpx.get(f"{realm.gateway}/readyz").status_code == 200, f"{state}\n{log}"
    assert httpx.get(f"{realm.gateway}/v1/models", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    assert running.appliance.run("audit", "verify", timeout=60).returncode == 0
