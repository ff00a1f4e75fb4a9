"""Alerts about the programs logins and answers depend on, firing in an appliance's real Prometheus
(an appliance of its own: stopping the session appliance's Keycloak would fail every module beside):
- Keycloak stopped with SIGSTOP stays RUNNING for supervisord, fails the gateway's probe of its
  /health/ready, and KeycloakDown fires; it ends once Keycloak runs on;
- PostgreSQL stopped so fails the gateway's connection probe, and PostgresDown fires;
- an engine killed twice, each time started again by supervisord, fires EngineCrashLooping.
The probes first show up against the real servers: Keycloak's readiness and PostgreSQL's answer to
a connection (a startup packet as Keycloak's role, no password), each 1 in Prometheus."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from appliance.supervisor import ProcessInfo, ProcessState, Supervisor
from tests.support.appliances import Appliance, make_appliance
from tests.support.scrape import prometheus_alerts, prometheus_get, prometheus_url

# It starts an engine, Keycloak and PostgreSQL of its own, as test_keycloak_postgres does.
pytestmark = pytest.mark.alone
DEADLINE_S = 600  # far beyond a minute's `for` on a loaded machine: a deadline, not a measure
SCRAPE_S = "2"


@pytest.fixture(scope="module")
def appliance(demo_model: Path, keycloak_dist: Path) -> Iterator[Appliance]:
    for made in make_appliance(demo_model, keycloak_dist, APPLIANCE_MONITORING__SCRAPE_INTERVAL_S=SCRAPE_S):
        started = made.run("up")
        assert started.returncode == 0, started.stdout + started.stderr
        yield made


@pytest.fixture(scope="module")
def prometheus(appliance: Appliance) -> str:
    return prometheus_url(appliance)


def process(appliance: Appliance, name: str) -> ProcessInfo:
    [info] = [p for p in Supervisor(appliance.home).processes() if p.name == name]
    return info


def dependencies_up(appliance: Appliance, url: str) -> dict[str, float]:
    """appliance_dependency_up as Prometheus last scraped it, by dependency."""
    found = prometheus_get(appliance, url, "/api/v1/query", query='appliance_dependency_up{job="gateway"}')
    return {series["metric"]["dependency"]: float(series["value"][1]) for series in found["result"]}


def until(what: str, holds: Any, deadline_s: float = DEADLINE_S) -> None:
    """Poll `holds()` until it is true, or fail naming `what`."""
    deadline = time.monotonic() + deadline_s
    while not holds():
        assert time.monotonic() < deadline, f"{what}: not within {deadline_s} s"
        time.sleep(1)


def firing(appliance: Appliance, url: str, name: str) -> list[dict[str, Any]]:
    return [a for a in prometheus_alerts(appliance, url, name) if a["state"] == "firing"]


def all_answer(appliance: Appliance, url: str) -> None:
    """Keycloak ready and PostgreSQL answering, as Prometheus saw them,
    and neither alert held: whichever test ran before has been recovered from."""
    expected = {"keycloak": 1.0, "postgres": 1.0}
    until("Keycloak and PostgreSQL answering the probes",
          lambda: dependencies_up(appliance, url) == expected)
    until("KeycloakDown and PostgresDown ended", lambda: not prometheus_alerts(appliance, url, "KeycloakDown")
          and not prometheus_alerts(appliance, url, "PostgresDown"))


@pytest.mark.parametrize(("program", "alert", "probe"), [("keycloak", "KeycloakDown", "keycloak"),
                                                          ("postgres", "PostgresDown", "postgres")])
def test_a_stopped_program_that_supervisord_counts_running_pages(appliance: Appliance, prometheus: str,
                                                                 program: str, alert: str, probe: str) -> None:
    all_answer(appliance, prometheus)
    stopped = process(appliance, program)
    assert stopped.state == ProcessState.RUNNING and stopped.pid > 1
    os.killpg(stopped.pid, signal.SIGSTOP)  # the program's own group (supervisord gives each one)
    stopped_at = time.monotonic()
    try:
        until(f"the {probe} probe failing", lambda: dependencies_up(appliance, prometheus).get(probe) == 0.0)
        failing_s = time.monotonic() - stopped_at
        until(f"{alert} firing", lambda: firing(appliance, prometheus, alert))
        fired_s = time.monotonic() - stopped_at
        [fired] = firing(appliance, prometheus, alert)
        assert fired["labels"]["severity"] == "page" and fired["labels"]["job"] == "gateway"
        # supervisord's state alone (the rule before the probe) would never have fired it.
        still = process(appliance, program)
        assert (still.state, still.pid) == (ProcessState.RUNNING, stopped.pid)
    finally:
        os.killpg(stopped.pid, signal.SIGCONT)
    continued_at = time.monotonic()
    all_answer(appliance, prometheus)  # it ends once the program answers again
    print(f"{program} stopped -> probe failing in Prometheus {failing_s:.0f} s, {alert} firing {fired_s:.0f} s; "
          f"continued -> ended {time.monotonic() - continued_at:.0f} s")


def started_again(appliance: Appliance, name: str, before: int) -> bool:
    """Whether supervisord runs `name` again, as a new process leading its own group."""
    pid = process(appliance, name).pid
    try:
        return pid not in (0, before) and os.getpgid(pid) == pid
    except ProcessLookupError:  # ended already: the next one will do
        return False


def test_an_engine_killed_twice_fires_engine_crash_looping(appliance: Appliance, prometheus: str) -> None:
    [engine] = [p for p in Supervisor(appliance.home).processes() if p.name.startswith("vllm-")]
    until("the engine running", lambda: process(appliance, engine.name).state == ProcessState.RUNNING)
    assert not prometheus_alerts(appliance, prometheus, "EngineCrashLooping")
    began = time.monotonic()
    for _ in range(2):
        victim = process(appliance, engine.name).pid
        assert victim > 1
        os.killpg(victim, signal.SIGKILL)  # the engine and its workers: supervisord starts it again
        until("supervisord starting the engine again", partial(started_again, appliance, engine.name, victim))
    until("EngineCrashLooping firing", lambda: firing(appliance, prometheus, "EngineCrashLooping"))
    [fired] = firing(appliance, prometheus, "EngineCrashLooping")
    assert fired["labels"]["program"] == engine.name and fired["labels"]["pool"]
    assert fired["labels"]["severity"] == "page" and float(fired["value"]) >= 2
    print(f"engine killed twice -> EngineCrashLooping firing {time.monotonic() - began:.0f} s "
          f"(value {float(fired['value']):.1f})")
