"""The watchdog on the real appliance: an engine wedged with SIGSTOP (alive, its socket accepting,
answering nothing) gets requests a 503 from the gateway within seconds, the first one sent right
after the wedge included (never a hang until the client gives up); the watchdog restarts it through
supervisord, with an audit record of why, traffic through the gateway recovers, and the
EngineHealed alert reaches the webhook receiver."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from typing import Any

import httpx
import psutil
import pytest

from appliance.supervisor import ProcessState, Supervisor
from audit.writer import log_files
from tests.integration.conftest import Running
from tests.integration.realm import Realm
from tests.integration.test_alerts_firing import restart_program
from tests.support.webhook import firing, webhook_receiver

# It wedges the session's engine.
pytestmark = pytest.mark.session_exclusive


def engine_info(running: Running) -> tuple[ProcessState, int]:
    [info] = [p for p in Supervisor(running.appliance.home).processes() if p.name == "vllm-main"]
    return info.state, info.pid


def records(running: Running) -> list[dict[str, Any]]:
    return [json.loads(line) for path in log_files(running.appliance.home.audit)
            for line in path.read_bytes().splitlines()]


def test_a_wedged_engine_is_restarted_and_traffic_recovers(running: Running) -> None:
    restart_program(running, "gateway")  # the router of this checkout (the session may have started before it)
    with webhook_receiver(running.appliance.env["APPLIANCE_MONITORING__WEBHOOK_URL"]) as posts:
        wedge_and_recover(running, posts)


def wedge_and_recover(running: Running, posts: list[dict[str, Any]]) -> None:
    realm = Realm(running)
    chat = {"url": f"{realm.gateway}/v1/chat/completions", "timeout": 60,
            "headers": {"Authorization": f"Bearer {realm.admin_token()}"},
            "json": {"model": "SmolLM2-135M-Instruct", "max_tokens": 4,
                     "messages": [{"role": "user", "content": "Hi"}]}}
    assert httpx.post(**chat).status_code == 200
    state, wedged = engine_info(running)
    assert state == ProcessState.RUNNING
    group = [wedged, *(p.pid for p in psutil.Process(wedged).children(recursive=True))]
    os.killpg(wedged, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        # Sent at once, before the router's health check has failed: it may reach the stopped
        # engine and wait there until the router gives it up, or be refused as the engine is set aside.
        first = httpx.post(**chat)
        first_s = time.monotonic() - stopped_at
        assert first.status_code == 503, first.text
        assert first.json()["error"]["code"] in ("engine_not_answering", "engine_unavailable"), first.text
        later = []
        for _ in range(3):
            asked = time.monotonic()
            answer = httpx.post(**chat)
            later.append(time.monotonic() - asked)
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "engine_unavailable", answer.text
        while engine_info(running)[1] in (wedged, 0):
            assert time.monotonic() - stopped_at < 240, "the watchdog did not restart the wedged engine"
            time.sleep(1)
        restarted_s = time.monotonic() - stopped_at
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(wedged, signal.SIGCONT)  # the test failed: leave no stopped engine behind
    # Nothing of the wedged engine is left (its processes were killed, not asked to stop).
    assert not [pid for pid in group if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    while (answer := httpx.post(**chat)).status_code != 200:
        assert answer.status_code == 503, answer.text  # set aside while it restarts: a fast 503, never a hang
        assert time.monotonic() - stopped_at < 600, "traffic did not recover"
        time.sleep(1)
    recovered_s = time.monotonic() - stopped_at
    [restart] = [r for r in records(running) if r["action"] == "engine.restarted"
                 and f"(pid {wedged})" in (r.get("detail") or "")]
    assert restart["username"] == restart["client"] == "watchdog"
    assert restart["target"]["name"] == "vllm-main" and "health check has not answered" in restart["detail"]
    # Prometheus sees the watchdog's count go up; Alertmanager posts after its group wait (10 s).
    while not firing(posts, "EngineHealed", program="vllm-main", pool="main", reason="unhealthy"):
        assert time.monotonic() - stopped_at < recovered_s + 180, f"no EngineHealed alert at the webhook: {posts}"
        time.sleep(1)
    alerted_s = time.monotonic() - stopped_at
    print(f"wedged -> first request's 503 {first_s:.1f} s ({first.json()['error']['code']}), later 503s "
          f"{max(later):.2f} s at most, -> restarted {restarted_s:.0f} s, -> traffic recovered {recovered_s:.0f} s, "
          f"-> alert at the webhook {alerted_s:.0f} s")
