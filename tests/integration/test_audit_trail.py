"""Every /v1 request through the real gateway leaves a durable, verifiable audit record; an
unwritable log makes the gateway fail closed (issue 4, first part)."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from audit.writer import log_files
from tests.integration.conftest import Running
from tests.integration.realm import Realm

# It kills the session's gateway, fills its disk and counts what reaches its audit log.
pytestmark = pytest.mark.session_exclusive

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


def test_up_is_recorded_as_a_local_change(running: Running) -> None:
    # The first: a module may have stopped the session appliance and started it again since.
    up, *_again = [r for r in records(running) if r["action"] == "appliance.up"]
    assert (up["outcome"], up["client"], up["source"]) == ("allowed", "appliance-cli", "local")
    assert re.fullmatch(r"settings [0-9a-f]{16}", up["resource"]), "which settings the start used"


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


def test_a_polling_dashboard_adds_a_record_per_interval_not_per_poll(realm: Realm, running: Running) -> None:
    """Monitoring reads (services, host, pools...) are summarised per user and interval (5 min);
    reads of users are each recorded, as are changes."""
    admin = {"Authorization": f"Bearer {realm.admin_token()}"}
    with httpx.Client(headers=admin, timeout=60) as http:
        polls = [http.get(f"{realm.gateway}/admin/{what}") for _ in range(5) for what in ("services", "system")]
        reads = [http.get(f"{realm.gateway}/admin/users") for _ in range(2)]
    assert all(r.status_code == 200 for r in polls + reads)
    written = {r["request_id"]: r["action"] for r in records(running)}
    polled = [written[r.headers["x-request-id"]] for r in polls if r.headers["x-request-id"] in written]
    assert polled.count("services.list") <= 1 and polled.count("system.read") <= 1, polled
    assert [written.get(r.headers["x-request-id"]) for r in reads] == ["users.list", "users.list"]


def test_full_disk_fails_closed_and_recovers(realm: Realm, running: Running) -> None:
    """Disk full, simulated with a file size limit on the running gateway (RLIMIT_FSIZE: writes
    past it fail with EFBIG; Python ignores SIGXFSZ): requests get 503, /readyz says why, and
    once space returns the gateway goes on by itself, chain intact."""
    pid = gateway_pid(running)
    current = log_files(running.appliance.home.audit)[-1]
    token = realm.token("ivan", "Test-password-1")
    headers = {"Authorization": f"Bearer {token}"}
    chat = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    size = current.stat().st_size
    # Only the soft limit moves: raising a hard limit back needs privileges the host may not give.
    soft, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (size, hard))
    try:
        refused = httpx.post(f"{realm.gateway}/v1/chat/completions", headers=headers, json=chat, timeout=120)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "audit_unavailable"
        again = httpx.get(f"{realm.gateway}/v1/models", headers=headers)
        assert again.status_code == 503
        time.sleep(1)  # /readyz checks again at most once a second
        ready = httpx.get(f"{realm.gateway}/readyz")
        assert ready.status_code == 503 and ready.json()["checks"]["audit"] is False
        assert ready.json()["reason"] == "audit log not writable"
        # Issue 17: anonymous callers learn no path or OS error; the gateway's log has them.
        for answer in (refused.text, again.text, ready.text):
            assert "File too large" not in answer and str(running.appliance.home.root) not in answer
        assert "File too large" in (running.appliance.home.logs / "gateway.log").read_text()
    finally:
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (soft, hard))
    deadline = time.monotonic() + 30
    while httpx.get(f"{realm.gateway}/readyz").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert httpx.post(f"{realm.gateway}/v1/chat/completions", headers=headers, json=chat,
                      timeout=120).status_code == 200
    verified = running.appliance.run("audit", "verify", timeout=60)
    assert verified.returncode == 0, verified.stderr


def test_gateway_killed_under_load_keeps_every_answered_record(realm: Realm, running: Running) -> None:
    """kill -9 of the gateway while clients keep sending: supervisord restarts it, and every
    request that got a complete answer, before or after the crash, has its record; verify passes."""
    before = gateway_pid(running)
    headers = {"Authorization": f"Bearer {realm.admin_token()}"}
    chat = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    answered: list[str] = []
    stop = threading.Event()

    def client(chatty: bool) -> None:
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                try:
                    response = (http.post(f"{realm.gateway}/v1/chat/completions", headers=headers, json=chat)
                                if chatty else http.get(f"{realm.gateway}/v1/models", headers=headers))
                except httpx.HTTPError:
                    time.sleep(0.05)  # the gateway is down or restarting
                    continue
                if response.status_code == 200:
                    answered.append(response.headers["x-request-id"])

    clients = [threading.Thread(target=client, args=(i < 2,)) for i in range(8)]
    for thread in clients:
        thread.start()
    try:
        wait_until(lambda: len(answered) >= 40, "load before the crash")
        os.kill(before, signal.SIGKILL)
        at_crash = len(answered)
        wait_until(lambda: gateway_pid(running) not in (before, 0), "supervisord restarting the gateway")
        wait_until(lambda: len(answered) >= at_crash + 20, "answers after the restart")
    finally:
        stop.set()
        for thread in clients:
            thread.join(60)
    recorded = {r["request_id"] for r in records(running)}
    missing = [request_id for request_id in answered if request_id not in recorded]
    assert not missing, f"{len(missing)} of {len(answered)} answered requests have no record"
    verified = running.appliance.run("audit", "verify", timeout=120)
    assert verified.returncode == 0 and "audit log OK" in verified.stdout, verified.stderr


def test_gateway_archives_closed_files_to_the_store(realm: Realm, running: Running) -> None:
    """The gateway copies closed log files to the (local) artifact store by itself; the copies
    verify on their own."""
    headers = {"Authorization": f"Bearer {realm.admin_token()}"}
    audit = running.appliance.home.audit
    with httpx.Client(timeout=30) as http:
        while len(log_files(audit)) < 2:
            assert http.get(f"{realm.gateway}/v1/models", headers=headers).status_code == 200
    archived = running.appliance.home.root / "artifacts" / "audit" / "audit-000001.jsonl"
    wait_until(archived.exists, "the gateway's archive timer")
    verified = running.appliance.run("audit", "verify", "--from-archive", timeout=120)
    assert verified.returncode == 0 and "audit log OK (archive" in verified.stdout, verified.stderr


def gateway_pid(running: Running) -> int:
    status = json.loads(running.appliance.run("status", "--json").stdout)
    return next(p["pid"] for p in status["programs"] if p["name"] == "gateway") or 0


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
