"""Every /v1 request through the real gateway leaves a durable, verifiable audit record; an
unwritable log makes the gateway fail closed (issue 4, first part)."""

from __future__ import annotations

import json
import resource
import time

import httpx
import pytest

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


def test_full_disk_fails_closed_and_recovers(realm: Realm, running: Running) -> None:
    """Disk full, simulated with a file size limit on the running gateway (RLIMIT_FSIZE: writes
    past it fail with EFBIG; Python ignores SIGXFSZ): requests get 503, /readyz says why, and
    once space returns the gateway goes on by itself, chain intact."""
    status = json.loads(running.appliance.run("status", "--json").stdout)
    [gateway] = [p for p in status["programs"] if p["name"] == "gateway"]
    current = log_files(running.appliance.home.audit)[-1]
    token = realm.token("ivan", "Test-password-1")
    headers = {"Authorization": f"Bearer {token}"}
    chat = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    size = current.stat().st_size
    # Only the soft limit moves: raising a hard limit back needs privileges the host may not give.
    soft, hard = resource.prlimit(gateway["pid"], resource.RLIMIT_FSIZE)
    resource.prlimit(gateway["pid"], resource.RLIMIT_FSIZE, (size, hard))
    try:
        refused = httpx.post(f"{realm.gateway}/v1/chat/completions", headers=headers, json=chat, timeout=120)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "audit_unavailable"
        assert "File too large" in refused.json()["error"]["message"]
        again = httpx.get(f"{realm.gateway}/v1/models", headers=headers)
        assert again.status_code == 503
        ready = httpx.get(f"{realm.gateway}/readyz")
        assert ready.status_code == 503 and ready.json()["checks"]["audit"] is False
        assert "not writable" in ready.json()["reason"]
    finally:
        resource.prlimit(gateway["pid"], resource.RLIMIT_FSIZE, (soft, hard))
    deadline = time.monotonic() + 30
    while httpx.get(f"{realm.gateway}/readyz").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert httpx.post(f"{realm.gateway}/v1/chat/completions", headers=headers, json=chat,
                      timeout=120).status_code == 200
    verified = running.appliance.run("audit", "verify", timeout=60)
    assert verified.returncode == 0, verified.stderr
