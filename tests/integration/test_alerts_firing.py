"""Alerts of the shipped rules firing in the session appliance's real Prometheus: the audit
directory made full (a file size limit on the running gateway, as in test_audit_trail), every
request refused meanwhile, and AuditLogNotWritable firing at /api/v1/alerts although the writer's
retries make its writable flag flap; it ends once the log takes records again."""

from __future__ import annotations

import resource
import time

import httpx
import pytest

from appliance.supervisor import ProcessState, Supervisor
from audit.writer import log_files
from tests.integration.conftest import SESSION_SETTINGS, Running
from tests.integration.realm import Realm
from tests.support.scrape import prometheus_alerts, prometheus_url

# It fills the audit disk (every request is refused) and restarts the gateway.
pytestmark = pytest.mark.session_exclusive


def restart_program(running: Running, name: str) -> None:
    """Start `name` again, so that it runs this checkout's code (the session appliance may have been
    started before it changed), and wait for the gateway to be ready."""
    supervisor = Supervisor(running.appliance.home)
    supervisor.call("stopProcess", name, True)
    supervisor.call("startProcess", name, True)
    ready = f"http://127.0.0.1:{running.appliance.port('APPLIANCE_GATEWAY__PORT')}/readyz"
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(ready, timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"the gateway is not ready after {name} started again"
        time.sleep(0.5)


def test_a_full_audit_disk_fires_audit_log_not_writable(running: Running) -> None:
    home = running.appliance.home
    restart_program(running, "gateway")  # the writer's failure count and last write time
    supervisor = Supervisor(home)
    supervisor.call("signalProcess", "prometheus", "HUP")  # the shipped rules as they are now
    url = prometheus_url(running.appliance)
    realm = Realm(running)
    headers = {"Authorization": f"Bearer {realm.admin_token()}"}
    models = f"{realm.gateway}/v1/models"
    [gateway] = [p for p in supervisor.processes() if p.name == "gateway"]
    assert gateway.state == ProcessState.RUNNING
    # A file at its rotation size would send the next record to a fresh file, which the limit lets
    # grow: requests first move the log on to a file with room.
    rotate_at = int(SESSION_SETTINGS["APPLIANCE_AUDIT__MAX_FILE_BYTES"])
    while (size := log_files(home.audit)[-1].stat().st_size) >= rotate_at:
        assert httpx.get(models, headers=headers, timeout=60).status_code == 200
    assert not prometheus_alerts(running.appliance, url, "AuditLogNotWritable")
    soft, hard = resource.prlimit(gateway.pid, resource.RLIMIT_FSIZE)
    resource.prlimit(gateway.pid, resource.RLIMIT_FSIZE, (size, hard))  # writes past it fail (EFBIG)
    full_at = time.monotonic()
    refused: list[int] = []
    try:
        while True:  # clients keep asking, and are refused, until the alert fires
            answer = httpx.get(models, headers=headers, timeout=60)
            refused.append(answer.status_code)
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "audit_unavailable", answer.text
            if any(a["state"] == "firing" for a in prometheus_alerts(running.appliance, url, "AuditLogNotWritable")):
                break
            assert time.monotonic() - full_at < 600, "AuditLogNotWritable never fired"
            time.sleep(0.5)
        fired_s = time.monotonic() - full_at
    finally:
        resource.prlimit(gateway.pid, resource.RLIMIT_FSIZE, (soft, hard))
    [firing] = [a for a in prometheus_alerts(running.appliance, url, "AuditLogNotWritable") if a["state"] == "firing"]
    assert firing["labels"]["severity"] == "page" and firing["labels"]["job"] == "gateway"
    # Space back: the next request is written, and the alert ends.
    while httpx.get(models, headers=headers, timeout=60).status_code != 200:
        assert time.monotonic() - full_at < fired_s + 120, "the gateway did not take requests again"
        time.sleep(0.5)
    while prometheus_alerts(running.appliance, url, "AuditLogNotWritable"):
        assert time.monotonic() - full_at < fired_s + 240, "AuditLogNotWritable did not end"
        time.sleep(0.5)
    print(f"audit disk full -> AuditLogNotWritable firing {fired_s:.0f} s ({len(refused)} requests refused)")
