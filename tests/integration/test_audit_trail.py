"""Every /v1 request through the real gateway leaves a durable, verifiable audit record; an
unwritable log makes the gateway fail closed."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from appliance.secrets import secret
from audit.writer import log_files
from installer.realm import BOOTSTRAP_SECRET
from tests.integration.conftest import SESSION_SETTINGS, Running
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
    # From a source of its own: a refusal from a source that was refused already this interval is
    # counted into a summary (another module's may have been).
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.79")) as stranger:
        denied = stranger.get(f"{realm.gateway}/v1/models")
    assert denied.status_code == 401

    by_id = {r["request_id"]: r for r in records(running)}
    record = by_id[chat.headers["x-request-id"]]
    assert record["action"] == "chat.completions" and record["outcome"] == "allowed"
    assert record["username"] == "ivan" and record["client"] == "appliance-cli"
    assert record["source"] == "127.0.0.1" and record["model"] == MODEL and record["status"] == 200
    assert record["resource"] == "/v1/chat/completions" and record["reason"] is None
    assert record["prompt_tokens"] > 0 and record["completion_tokens"] > 0
    assert len(record["prompt_hmac"]) == 64 and len(record["completion_hmac"]) == 64
    assert record["prompt"] is None and record["completion"] is None, "raw text only when capture is on"
    assert "secret prompt 42" not in json.dumps(records(running))
    stream_record = by_id[streamed.headers["x-request-id"]]
    assert stream_record["completion_tokens"] > 0 and stream_record["completion_hmac"]
    denial = by_id[denied.headers["x-request-id"]]
    assert denial["action"] == "auth.denied" and denial["outcome"] == "denied" and denial["status"] == 401
    assert denial["reason"] == "missing_token"

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
    assert up["resource"] == "cli"
    assert re.fullmatch(r"settings [0-9a-f]{16}", up["detail"]), "which settings the start used"


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
    assert (disable["action"], disable["resource"]) == ("users.disable", "/admin/users/kate/disable")
    assert add["target"] == {"kind": "user", "name": "kate", "version": None, "roles": ["user"]}
    assert disable["target"] == {"kind": "user", "name": "kate", "version": None, "roles": None}


def test_a_polling_dashboard_adds_a_record_per_interval_not_per_poll(realm: Realm, running: Running) -> None:
    """Monitoring reads (services, host, pools...) are summarised per user and interval (5 min);
    other admin reads per user, path and query: a new query has its own record, a refresh not."""
    admin = {"Authorization": f"Bearer {realm.admin_token()}"}
    query = {"newest": "true", "limit": "7", "action": f"never.{time.monotonic_ns()}"}  # a query of this run's
    with httpx.Client(headers=admin, timeout=60) as http:
        polls = [http.get(f"{realm.gateway}/admin/{what}") for _ in range(5) for what in ("services", "system")]
        reads = [http.get(f"{realm.gateway}/admin/audit", params=query) for _ in range(3)]
        other = http.get(f"{realm.gateway}/admin/audit", params={**query, "limit": "8"})
    assert all(r.status_code == 200 for r in [*polls, *reads, other])
    written = {r["request_id"]: r["action"] for r in records(running)}
    polled = [written[r.headers["x-request-id"]] for r in polls if r.headers["x-request-id"] in written]
    assert polled.count("services.list") <= 1 and polled.count("system.read") <= 1, polled
    assert [written.get(r.headers["x-request-id"]) for r in reads] == ["audit.query", None, None]
    assert written.get(other.headers["x-request-id"]) == "audit.query", "a new query has its own record"


def test_full_disk_fails_closed_and_recovers(realm: Realm, running: Running) -> None:
    """Disk full, simulated with a file size limit on the running gateway (RLIMIT_FSIZE: writes
    past it fail with EFBIG; Python ignores SIGXFSZ): requests get 503, /readyz says why, and
    once space returns the gateway goes on by itself, chain intact."""
    pid = gateway_pid(running)
    token = realm.token("ivan", "Test-password-1")
    headers = {"Authorization": f"Bearer {token}"}
    chat = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    # A file at its rotation size would send the next record to a fresh file, which the limit
    # below lets grow: a request first moves the log on to a file with room.
    rotate_at = int(SESSION_SETTINGS["APPLIANCE_AUDIT__MAX_FILE_BYTES"])
    while (size := log_files(running.appliance.home.audit)[-1].stat().st_size) >= rotate_at:
        assert httpx.get(f"{realm.gateway}/v1/models", headers=headers).status_code == 200
    # Only the soft limit moves: raising a hard limit back needs privileges the host may not give.
    soft, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (size, hard))
    try:
        refused = httpx.post(f"{realm.gateway}/v1/chat/completions", headers=headers, json=chat, timeout=120)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "audit_unavailable"
        # /readyz checks again at most once a second, and the writer lets a write try again 2 s
        # after a failure: on a loaded host those windows pass between two calls. Each round
        # fails a write first, so /readyz's next check sees a failure that is fresh.
        deadline = time.monotonic() + 30
        while True:
            again = httpx.get(f"{realm.gateway}/v1/models", headers=headers)
            assert again.status_code == 503
            ready = httpx.get(f"{realm.gateway}/readyz")
            if ready.status_code == 503 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert ready.status_code == 503 and ready.json()["checks"]["audit"] is False
        assert ready.json()["reason"] == "audit log not writable"
        # Anonymous callers learn no path or OS error; the gateway's log has them.
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


def test_each_change_names_its_object_and_each_refusal_its_reason(realm: Realm, running: Running,
                                                                   tmp_path: Path) -> None:
    """The CLI's changes, through the admin API or on the host: each record names what it acted on
    (user and roles, key, dataset and its sha256, job); a refusal says why and whose fault."""
    cli = running.appliance
    login = cli.run("token", "--user", "admin", "--password-stdin",
                    stdin=secret(cli.home, BOOTSTRAP_SECRET) + "\n", timeout=60)
    assert login.returncode == 0, login.stderr
    name = f"dora{time.monotonic_ns() % 10**9}"
    for step in (("users", "add", name, "--role", "user"), ("users", "grant", name, "trainer"),
                 ("users", "revoke", name, "trainer"), ("users", "disable", name), ("users", "enable", name),
                 ("users", "reset-password", name), ("keys", "create", f"{name}-ci", "--user", name),
                 ("keys", "revoke", f"{name}-ci")):
        done = cli.run(*step, timeout=120)
        assert done.returncode == 0, (step, done.stderr)
    rows = [{"messages": [{"role": "user", "content": f"Item {i}?"}, {"role": "assistant", "content": f"It is {i}."}]}
            for i in range(20)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert cli.run("data", "add", str(data), "--name", f"{name}-set", timeout=300).returncode == 0
    taken = cli.run("data", "add", str(data), "--name", f"{name}-set", timeout=300)
    assert taken.returncode == 1 and "--replace" in taken.stderr
    queued = cli.run("finetune", "submit", "--data", f"{name}-set", "--name", f"{name}-bot", timeout=60)
    assert queued.returncode == 0, queued.stderr
    job = re.search(r"job (\d+) queued", queued.stdout).group(1)  # type: ignore[union-attr]
    assert cli.run("finetune", "cancel", job, timeout=60).returncode == 0
    token = realm.token("ivan", "Test-password-1")
    missing = httpx.post(f"{realm.gateway}/v1/chat/completions", headers={"Authorization": f"Bearer {token}"},
                         json={"model": "no-such-model", "messages": [{"role": "user", "content": "Hi"}]}, timeout=60)
    assert missing.status_code == 404

    def about(kind: str, target: str) -> list[dict]:
        return [r for r in records(running) if (r.get("target") or {}).get("kind") == kind
                and r["target"]["name"] == target]

    users = {r["action"]: r for r in about("user", name)}
    assert users["users.add"]["target"]["roles"] == ["user"]
    assert users["users.grant"]["target"]["roles"] == users["users.revoke"]["target"]["roles"] == ["trainer"]
    assert {"users.disable", "users.enable", "users.reset_password"} <= set(users)
    assert all(r["outcome"] == "allowed" and r["username"] == "admin" and r["client"] == "appliance-cli"
               for r in users.values())
    assert [r["action"] for r in about("key", f"{name}-ci")] == ["keys.create", "keys.revoke"]
    added, refused = about("dataset", f"{name}-set")
    assert (added["action"], added["outcome"], added["resource"]) == ("data.add", "allowed", "cli")
    assert re.fullmatch(r"[0-9a-f]{64}", str(added["target"]["version"])), "the version stored: its sha256"
    assert (refused["outcome"], refused["reason"], refused["status"]) == ("invalid", "conflict", 1)
    assert "exists" in refused["error"] and refused["target"]["version"] is None
    jobs = about("job", job)
    assert [r["action"] for r in jobs if r["client"] == "appliance-cli"] == ["finetune.submit", "finetune.cancel"]
    assert all(r["username"] == "finetune-worker" for r in jobs if r["action"] == "finetune.job"), \
        "the worker records the job's end as itself, never as root"
    [not_found] = [r for r in records(running) if r["request_id"] == missing.headers["x-request-id"]]
    assert (not_found["outcome"], not_found["reason"], not_found["model"]) == ("invalid", "model_not_found",
                                                                               "no-such-model")
