"""The watchdog's judgement of an engine replica, on a clock of the test's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.changes import Change
from appliance.home import Home
from appliance.programs import Program
from appliance.settings import Settings, WatchdogSettings
from serve import watchdog
from serve.watchdog import Observation, Replica, Watchdog, backoff_s, stall

LIMITS = WatchdogSettings(engine_stall_s=30, backoff_s=60, max_backoff_s=300)
IDLE, BUSY = Observation(healthy=True, held=0, tokens=100), Observation(healthy=True, held=3, tokens=100)
SILENT = Observation(healthy=False)


def replica(start_timeout_s: float = 600) -> Replica:
    return Replica(name="vllm-main", start_timeout_s=start_timeout_s, started_at=0.0, pid=4242)


def test_a_replica_still_starting_is_judged_only_after_its_start_timeout() -> None:
    starting = replica(start_timeout_s=600)
    assert stall(starting, SILENT, 599, LIMITS) is None  # loading weights: not answering yet is fine
    assert stall(starting, SILENT, 601, LIMITS) == ("it has not answered since it started 601 s ago (its start "
                                                   "timeout: 600 s)")
    quick = replica(start_timeout_s=10)  # a start timeout under the stall limit: the stall limit counts
    assert stall(quick, SILENT, 29, LIMITS) is None and stall(quick, SILENT, 31, LIMITS)


def test_an_idle_or_producing_replica_is_never_stalled() -> None:
    watched = replica()
    for second in range(0, 3000, 5):
        assert stall(watched, IDLE, second, LIMITS) is None
        assert stall(watched, Observation(healthy=True, held=2, tokens=100.0 + second), second + 1, LIMITS) is None


def test_held_requests_without_a_token_or_a_silent_health_check_stall_it() -> None:
    watched = replica()
    assert stall(watched, IDLE, 10, LIMITS) is None
    assert stall(watched, BUSY, 20, LIMITS) is None  # the same count of tokens: no progress since 10
    assert stall(watched, BUSY, 39, LIMITS) is None
    assert stall(watched, BUSY, 41, LIMITS) == "it has held 3 requests and produced no token for 31 s"
    answered = replica()
    assert stall(answered, IDLE, 100, LIMITS) is None
    assert stall(answered, SILENT, 129, LIMITS) is None
    assert stall(answered, SILENT, 131, LIMITS) == "its health check has not answered for 31 s"
    unreadable = replica()  # answering, its counters unreadable: not judged on them
    assert stall(unreadable, Observation(healthy=True), 1000, LIMITS) is None


def test_restarts_back_off_doubling_to_the_cap() -> None:
    assert [backoff_s(n, LIMITS) for n in range(1, 6)] == [60, 120, 240, 300, 300]


def test_a_stalled_replica_is_killed_recorded_and_held_back_while_its_backoff_runs(
        home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    killed: list[int] = []
    recorded: list[Change] = []
    monkeypatch.setattr(watchdog, "kill", killed.append)
    monkeypatch.setattr(watchdog, "announce", recorded.append)
    dog = Watchdog(Settings(watchdog=LIMITS), home)
    program = Program(name="vllm-main", command=["vllm"], pool="main", socket=Path("/nonexistent.sock"))
    stuck = replica()
    dog._restart(stuck, program, "its health check has not answered for 31 s", now=100)
    assert killed == [4242] and stuck.restarts == 1 and stuck.next_restart_at == 160
    [first] = recorded
    assert (first.action, first.actor, first.target and first.target.name) == ("engine.restarted", "watchdog",
                                                                                "vllm-main")
    assert "health check" in (first.detail or "") and "restart 1" in (first.detail or "")
    for now in (110, 120):  # wedged again at once: held back, recorded once
        dog._restart(stuck, program, "its health check has not answered for 31 s", now=now)
    assert killed == [4242] and [c.action for c in recorded] == ["engine.restarted", "engine.restart_held_back"]
    dog._restart(stuck, program, "it has held 1 requests and produced no token for 31 s", now=161)
    assert killed == [4242, 4242] and stuck.restarts == 2 and stuck.next_restart_at == 161 + 120
