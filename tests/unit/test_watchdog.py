"""The watchdog's judgement of an engine replica, on a clock of the test's own."""

from __future__ import annotations

import contextlib
import json
import socketserver
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from appliance import heals
from appliance.changes import Change
from appliance.errors import SettingsError, SupervisorError
from appliance.heals import Reason
from appliance.home import Home
from appliance.programs import Program
from appliance.settings import Settings, WatchdogSettings, load_settings
from appliance.supervisor import ProcessInfo, ProcessState
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


def test_a_long_prefill_filling_the_cache_is_not_taken_for_a_wedge() -> None:
    """A long prompt counts no token until its prefill ends, but fills the KV cache chunk by chunk."""
    prefilling = replica()
    assert stall(prefilling, Observation(healthy=True, held=1, tokens=100, kv_use=0.10), 10, LIMITS) is None
    for second in range(20, 200, 10):
        seen = Observation(healthy=True, held=1, tokens=100, kv_use=0.10 + second / 1000)
        assert stall(prefilling, seen, second, LIMITS) is None
    # Emptying is no progress (clients giving up on a stuck scheduler abort their requests).
    draining = replica()
    assert stall(draining, Observation(healthy=True, held=2, tokens=100, kv_use=0.5), 10, LIMITS) is None
    for second in (20, 30, 39):
        assert stall(draining, Observation(healthy=True, held=2, tokens=100, kv_use=0.5 - second / 100), second,
                     LIMITS) is None
    assert stall(draining, Observation(healthy=True, held=2, tokens=100, kv_use=0.01), 41, LIMITS) is not None
    # The cache stops moving too: wedged after the stall limit.
    still = Observation(healthy=True, held=1, tokens=100, kv_use=0.10 + 190 / 1000)  # as at 190
    assert stall(prefilling, still, 200, LIMITS) is None
    assert stall(prefilling, still, 221, LIMITS) == "it has held 1 requests and produced no token for 31 s"


def test_restarts_back_off_doubling_to_the_cap() -> None:
    assert [backoff_s(n, LIMITS) for n in range(1, 6)] == [60, 120, 240, 300, 300]


class FakeSupervisor:
    """supervisord's answers about one program, as the test sets them."""

    def __init__(self) -> None:
        self.state, self.pid, self.started, self.refuse = ProcessState.RUNNING, 4242, 0, False

    def info(self) -> dict[str, Any]:
        return {"name": "vllm-main", "state": self.state, "pid": self.pid, "now": 1000, "start": 400,
                "stdout_logfile": "/dev/null", "description": ""}

    def processes(self) -> list[ProcessInfo]:
        return [ProcessInfo.from_rpc(self.info())]

    def call(self, method: str, *args: object) -> dict[str, Any]:
        if method == "startProcess":
            assert args == ("vllm-main", False)
            if self.refuse:
                raise SupervisorError("supervisord refused startProcess: SPAWN_ERROR: vllm-main")
            self.started += 1
            self.state = ProcessState.STARTING
            return {}
        assert method == "getProcessInfo" and args == ("vllm-main",)
        return self.info()


@dataclass
class World:
    """What the watchdog sees and does, handed in: supervisord's answers, a clock the test moves,
    what each look at the replica finds, and the pids it killed and the records it made."""

    supervisor: FakeSupervisor = field(default_factory=FakeSupervisor)
    now: float = 1000.0
    seen: Observation = SILENT
    killed: list[int] = field(default_factory=list)
    recorded: list[Change] = field(default_factory=list)


@pytest.fixture
def world() -> World:
    return World()


@pytest.fixture
def dog(home: Home, world: World) -> Watchdog:
    return Watchdog(Settings(watchdog=LIMITS), home, supervisor=world.supervisor,  # type: ignore[arg-type]
                    clock=lambda: world.now, probe=lambda program, key: world.seen, kill=world.killed.append,
                    announce=world.recorded.append)


def test_a_stalled_replica_is_killed_recorded_and_held_back_while_its_backoff_runs(dog: Watchdog,
                                                                                   world: World) -> None:
    killed, recorded = world.killed, world.recorded
    program = Program(name="vllm-main", command=["vllm"], pool="main", socket=Path("/nonexistent.sock"))
    stuck = replica()
    dog._restart(stuck, program, "its health check has not answered for 31 s", Reason.UNHEALTHY, now=100)
    assert killed == [4242] and stuck.restarts == 1 and stuck.next_restart_at == 160
    [first] = recorded
    assert (first.action, first.actor, first.target and first.target.name) == ("engine.restarted", "watchdog",
                                                                                "vllm-main")
    assert "health check" in (first.detail or "") and "restart 1" in (first.detail or "")
    for now in (110, 120):  # wedged again at once: held back, recorded once
        dog._restart(stuck, program, "its health check has not answered for 31 s", Reason.UNHEALTHY, now=now)
    assert killed == [4242] and [c.action for c in recorded] == ["engine.restarted", "engine.restart_held_back"]
    dog._restart(stuck, program, "it has held 1 requests and produced no token for 31 s", Reason.NO_PROGRESS,
                 now=161)
    assert killed == [4242, 4242] and stuck.restarts == 2 and stuck.next_restart_at == 161 + 120
    # Counted by reason for the metrics, in a file that outlives the watchdog.
    assert heals.load(dog.home).restarts == {"vllm-main": {Reason.UNHEALTHY: 1, Reason.NO_PROGRESS: 1}}
    assert heals.load(dog.home).pools == {"vllm-main": "main"}


def test_restarts_are_remembered_across_the_replica_starting_again(dog: Watchdog, home: Home,
                                                                    world: World) -> None:
    """supervisord shows the killed replica STARTING, then RUNNING with a new pid: its backoff holds."""
    engine = Program(name="vllm-main", command=["vllm"], pool="main", socket=Path("/nonexistent.sock"),
                     start_timeout_s=10)
    (home.run / "programs.json").write_text(json.dumps([engine.model_dump(mode="json")]))
    killed, recorded, fake = world.killed, world.recorded, world.supervisor
    world.seen = SILENT
    dog.check()  # first seen past its start: a whole stall window from now
    world.now += 31
    dog.check()
    assert killed == [4242]
    fake.state = ProcessState.STARTING
    dog.check()
    fake.state, fake.pid = ProcessState.RUNNING, 5151
    for _ in range(4):  # wedged again at once, within its 60 s backoff
        world.now += 11
        dog.check()
    assert killed == [4242] and [c.action for c in recorded] == ["engine.restarted", "engine.restart_held_back"]
    world.now += 30
    dog.check()
    assert killed == [4242, 5151] and "restart 2" in (recorded[-1].detail or "")


def test_a_replica_supervisord_gave_up_on_is_started_again_as_its_backoff_allows(
        dog: Watchdog, home: Home, world: World) -> None:
    """A crash loop: supervisord ends at FATAL after its start retries; the watchdog starts it again,
    ever more slowly, each start audited; a stopped one (an administrator's) is left stopped."""
    engine = Program(name="vllm-main", command=["vllm"], pool="main", socket=Path("/nonexistent.sock"))
    (home.run / "programs.json").write_text(json.dumps([engine.model_dump(mode="json")]))
    recorded, fake = world.recorded, world.supervisor
    fake.state = ProcessState.FATAL
    dog.check()
    assert fake.started == 1 and [c.action for c in recorded] == ["engine.restarted"]
    assert "gave up on it (FATAL" in (recorded[0].detail or "") and "the next is allowed after 60 s" in (
        recorded[0].detail or "")
    fake.state = ProcessState.FATAL  # it crashed again at once
    for _ in range(5):
        world.now += 10
        dog.check()
    assert fake.started == 1 and [c.action for c in recorded] == ["engine.restarted", "engine.restart_held_back"]
    world.now += 11
    dog.check()
    assert fake.started == 2 and "start 2" in (recorded[-1].detail or "") and "after 120 s" in (
        recorded[-1].detail or "")
    fake.state = ProcessState.STOPPED
    world.now += 1000
    dog.check()
    assert fake.started == 2 and heals.load(home).restarts == {"vllm-main": {Reason.GAVE_UP: 2}}
    # supervisord refuses the start: recorded as an error, and backed off like a crash (no retry each look).
    fake.state, fake.refuse = ProcessState.FATAL, True
    dog.check()
    assert recorded[-1].outcome == "error" and "start 3 refused: supervisord refused" in (recorded[-1].detail or "")
    for _ in range(10):
        world.now += 1
        dog.check()
    assert [c.action for c in recorded].count("engine.restarted") == 3 and recorded[-1].action == \
        "engine.restart_held_back"


@pytest.mark.parametrize("planted", ["link", "directory", "garbage", "huge"])
def test_a_planted_or_broken_heals_file_counts_from_zero(home: Home, tmp_path: Path, planted: str) -> None:
    path = home.run / "watchdog-restarts.json"
    target = tmp_path / "elsewhere.json"
    target.write_text('{"restarts": {"vllm-main": {"gave_up": 7}}}')
    if planted == "link":
        path.symlink_to(target)
    elif planted == "directory":
        path.mkdir()
    elif planted == "garbage":
        path.write_text('{"restarts": {"vllm-main": {"gave_up": -1}}}')
    else:
        path.write_bytes(b" " * (heals.MAX_BYTES + 1))
    assert heals.load(home) == heals.Heals()


def test_a_replica_that_changed_meanwhile_is_not_killed(dog: Watchdog, world: World) -> None:
    program = Program(name="vllm-main", command=["vllm"], pool="main", socket=Path("/nonexistent.sock"))
    stale = replica()
    world.supervisor.pid = 6001  # supervisord started it again since the look
    dog._restart(stale, program, "its health check has not answered for 31 s", Reason.UNHEALTHY, now=100)
    assert world.killed == [] and world.recorded == [] and stale.restarts == 0


@pytest.mark.parametrize("pid", [1, 0, -5])
def test_no_pid_that_would_reach_other_processes_is_killed(pid: int) -> None:
    with pytest.raises(ValueError, match="refusing"):
        watchdog.kill(pid)


class Flood(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        if self.path == "/metrics" and self.server.compressed:  # type: ignore[attr-defined]
            self.send_header("Content-Encoding", "gzip")
        self.end_headers()
        if self.path == "/metrics":
            chunk = b"vllm:num_requests_running 1\n" * 4096
            with contextlib.suppress(OSError):
                for _ in range(watchdog.MAX_ANSWER_BYTES // len(chunk) + 2):
                    self.wfile.write(chunk)

    def log_message(self, *args: Any) -> None:
        pass


class UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def get_request(self) -> tuple[Any, Any]:
        request, _ = super().get_request()
        return request, ("local", 0)  # BaseHTTPRequestHandler wants an address pair


@pytest.mark.parametrize("compressed", [False, True])
def test_an_engine_answer_too_large_or_compressed_is_no_answer(tmp_path: Path, compressed: bool) -> None:
    socket_path = tmp_path / "engine.sock"
    server = UnixHTTPServer(str(socket_path), Flood)
    server.compressed = compressed  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        program = Program(name="vllm-main", command=["vllm"], pool="main", socket=socket_path)
        assert watchdog.observe(program, "k") == Observation(healthy=True)  # answering; counters unread
    finally:
        server.shutdown()
        server.server_close()


def test_a_cap_below_the_first_backoff_is_refused(home: Home) -> None:
    with pytest.raises(SettingsError, match="max_backoff_s"):
        load_settings(home.settings_file, environ={"APPLIANCE_WATCHDOG__BACKOFF_S": "600",
                                                   "APPLIANCE_WATCHDOG__MAX_BACKOFF_S": "60"})


DEFAULTS = WatchdogSettings()


def looks(settings: WatchdogSettings, until_s: float, *, silent_from_s: float | None = None) -> list[float]:
    """When the watchdog looks at a replica: every check_interval_s after the last look ended, a
    look at a silent replica (from `silent_from_s`) taking its health check's whole timeout."""
    at, times = 0.0, []
    while at < until_s:
        times.append(at)
        silent = silent_from_s is not None and at >= silent_from_s
        at += settings.check_interval_s + (watchdog.ASK_TIMEOUT_S if silent else 0.0)
    return times


def test_by_default_a_replica_that_stops_answering_is_restarted_within_30_s() -> None:
    for stopped_s in (100.0, 100.5, 101.0, 101.9):  # wherever between two looks it stops
        watched = replica()
        restarted_at = next(second for second in looks(DEFAULTS, 1000, silent_from_s=stopped_s)
                            if stall(watched, SILENT if second >= stopped_s else IDLE, second, DEFAULTS))
        assert restarted_at - stopped_s < 30, f"stopped at {stopped_s}: restarted {restarted_at - stopped_s:.0f} s on"


@pytest.mark.parametrize("token_every_s", [1, 5, 12, 19])
def test_by_default_a_request_producing_slowly_is_not_a_wedge(token_every_s: float) -> None:
    """A long generation on a slow engine: a token (and nothing else) now and then, less often than
    the watchdog looks but more often than engine_stall_s."""
    watched = replica()
    for second in looks(DEFAULTS, 600):
        tokens = 100 + second // token_every_s
        assert stall(watched, Observation(healthy=True, held=1, tokens=tokens, kv_use=0.2), second, DEFAULTS) is None


def test_by_default_a_long_prefill_is_not_a_wedge() -> None:
    """A prompt prefilled for minutes in chunks: no token counted until it ends, the KV cache
    filling at every chunk (a chunk every 10 s: a slow engine's chunk)."""
    watched = replica()
    for second in looks(DEFAULTS, 600):
        kv_use = 0.01 + (second // 10) / 1000
        assert stall(watched, Observation(healthy=True, held=1, tokens=100, kv_use=kv_use), second, DEFAULTS) is None


def test_the_watched_counters_are_read_as_the_whole_exposition_gives_them() -> None:
    """Only the watched families' lines are parsed: the totals are what parsing every line gives,
    whatever else (histograms, labels holding spaces, quotes and '#', look-alike names) is there."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    registry = CollectorRegistry()
    running = Gauge("vllm:num_requests_running", "Running", ["engine", "model_name"], registry=registry)
    waiting = Gauge("vllm:num_requests_waiting", "Waiting", ["engine"], registry=registry)
    prompt = Counter("vllm:prompt_tokens", "Prompt", ["engine"], registry=registry)
    generated = Counter("vllm:generation_tokens", "Generated", ["engine"], registry=registry)
    kv = Gauge("vllm:kv_cache_usage_perc", "KV", registry=registry)
    cached = Counter("vllm:prompt_tokens_cached", "Look-alike", ["engine"], registry=registry)
    latency = Histogram("vllm:e2e_request_latency_seconds", "Latency", ["engine"], registry=registry)
    for engine in ("0", "1"):
        running.labels(engine, 'a "model" # with spaces').set(2)
        waiting.labels(engine).set(3)
        prompt.labels(engine).inc(100)
        generated.labels(engine).inc(40)
        cached.labels(engine).inc(7)
        latency.labels(engine).observe(0.5)
    kv.set(0.25)
    exposition = generate_latest(registry).decode()

    everything: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        if family.name in watchdog.WATCHED:
            everything[family.name] = sum(s.value for s in family.samples if not s.name.endswith("_created"))
    assert watchdog._totals(exposition) == everything == {
        "vllm:num_requests_running": 4, "vllm:num_requests_waiting": 6, "vllm:prompt_tokens": 200,
        "vllm:generation_tokens": 80, "vllm:kv_cache_usage_perc": 0.25}
