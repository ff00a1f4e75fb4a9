"""The supervised `watchdog` (`python -m serve.watchdog`): restarts an engine replica that is alive
but makes no progress, and ends a worker whose work makes none (serve.stuck_work).

Every `watchdog.check_interval_s` it asks each engine replica, over its Unix socket, for its health
and its vLLM counters. A replica is stalled when, for `watchdog.engine_stall_s`, its health check
has not answered 200, or it has held requests (running or waiting) while neither its token
counters nor its KV-cache use moved (a long prompt's prefill counts no token until it ends, but
fills the cache chunk by chunk). A replica still starting is not judged until it has answered once
or its start timeout has passed. A replica supervisord gave up on (FATAL: it exited during each of
its starts) is started again, as its backoff allows.

A stalled replica's processes are killed (a wedged process may not heed SIGTERM: SIGSTOP, a
deadlock); supervisord starts it again, and the gateway's router, whose health check of it fails
meanwhile, sends it nothing until it answers. A replica's restarts back off (`backoff_s`, doubling
up to `max_backoff_s`), so one that wedges again at once does not thrash; one that then makes
progress that long starts over. Each restart, and each one held back, is an audit record of the
watchdog with its reason and figures.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from appliance import heals
from appliance.changes import Change, Target, announce
from appliance.errors import ApplianceError, SupervisorError
from appliance.heals import Reason
from appliance.home import Home
from appliance.lifecycle import started_programs
from appliance.programs import Program
from appliance.secrets import secret
from appliance.settings import Settings, WatchdogSettings, load_settings
from appliance.supervisor import ProcessInfo, ProcessState, Supervisor
from appliance.unix_http import unix_transport
from serve.engine import ENGINE_BASE_URL
from serve.stuck_work import end_stuck_workers

ACTOR = "watchdog"
ASK_TIMEOUT_S = 5.0  # each read
ASK_DEADLINE_S = 10.0  # a whole answer
MAX_ANSWER_BYTES = 4 << 20  # vLLM's /metrics is tens of kilobytes
BUSY = ("vllm:num_requests_running", "vllm:num_requests_waiting")
PROGRESS = ("vllm:generation_tokens", "vllm:prompt_tokens")  # counters (the exposition adds _total)
KV_USE = "vllm:kv_cache_usage_perc"  # a gauge that moves while a prefill fills the cache
WATCHED = (*BUSY, *PROGRESS, KV_USE)
log = logging.getLogger(ACTOR)


@dataclass(frozen=True)
class Observation:
    """One look at a replica: whether its health check answered, and its counters (None: no answer)."""

    healthy: bool
    held: float | None = None  # requests running or waiting
    tokens: float | None = None  # prompt and generated tokens so far
    kv_use: float | None = None  # share of the KV cache in use


@dataclass
class Replica:
    """What the watchdog remembers of one replica between looks."""

    name: str
    start_timeout_s: float
    started_at: float  # its process's start (monotonic), as the watchdog first saw it or restarted it
    pid: int = 0
    progress_at: float | None = None  # last seen answering and idle or producing; None: not since it started
    tokens: float | None = None
    kv_use: float | None = None
    restarts: int = 0
    next_restart_at: float = 0.0
    held_back: bool = False  # a restart held back by the backoff was recorded


def stall(replica: Replica, seen: Observation, now: float, settings: WatchdogSettings) -> str | None:
    """Why `replica` must be restarted after `seen`, or None. Updates what it remembers."""
    busy = seen.held is not None and seen.held > 0
    produced = seen.tokens is not None and replica.tokens is not None and seen.tokens > replica.tokens
    # The cache filling (a prefill's chunks) is progress; its emptying (requests aborted) is not.
    produced |= seen.kv_use is not None and replica.kv_use is not None and seen.kv_use > replica.kv_use
    if seen.healthy and (not busy or produced or seen.tokens is None or replica.tokens is None):
        replica.progress_at = now  # answering, and idle or producing (or its counters are not readable)
        if replica.restarts and now - replica.next_restart_at >= settings.max_backoff_s:
            replica.restarts = 0  # it has made progress past the longest backoff: start over
    if seen.tokens is not None:
        replica.tokens = seen.tokens
    if seen.kv_use is not None:
        replica.kv_use = seen.kv_use
    if replica.progress_at is None:  # not answered since it started: judged once its start timeout passed
        started_s = now - replica.started_at
        if started_s < max(replica.start_timeout_s, settings.engine_stall_s):
            return None
        return f"it has not answered since it started {started_s:.0f} s ago (its start timeout: " \
               f"{replica.start_timeout_s:.0f} s)"
    stalled_s = now - replica.progress_at
    if stalled_s < settings.engine_stall_s:
        return None
    if not seen.healthy:
        return f"its health check has not answered for {stalled_s:.0f} s"
    return f"it has held {seen.held:.0f} requests and produced no token for {stalled_s:.0f} s"


def backoff_s(restarts: int, settings: WatchdogSettings) -> float:
    """How long after its `restarts`-th restart a replica may be restarted again."""
    return float(min(settings.max_backoff_s, settings.backoff_s * 2 ** max(0, restarts - 1)))


def observe(program: Program, key: str) -> Observation:
    """Ask the replica for its health and its counters, over its Unix socket. Its answers are
    bounded (MAX_ANSWER_BYTES, ASK_DEADLINE_S each, no compression): an engine that trickles or
    floods is a replica that did not answer, never a watchdog that hangs or runs out of memory."""
    assert program.socket is not None  # engine programs listen on one
    transport = unix_transport(program.socket)
    with httpx.Client(transport=transport, base_url=ENGINE_BASE_URL, timeout=ASK_TIMEOUT_S) as engine:
        try:
            healthy = _ask(engine, "/health", {}, keep_body=False)[0] == 200
        except (httpx.HTTPError, ValueError):
            return Observation(healthy=False)
        try:
            status, body = _ask(engine, "/metrics", {"Authorization": f"Bearer {key}"}, keep_body=True)
            if status != 200:
                return Observation(healthy=healthy)
            totals = _totals(body.decode("utf-8", errors="replace"))
        except (httpx.HTTPError, ValueError):
            return Observation(healthy=healthy)
    return Observation(healthy=healthy, held=sum(totals.get(name, 0.0) for name in BUSY),
                       tokens=sum(totals.get(name, 0.0) for name in PROGRESS), kv_use=totals.get(KV_USE))


def _ask(engine: httpx.Client, path: str, headers: dict[str, str], *, keep_body: bool) -> tuple[int, bytes]:
    """GET `path`: its status and (if `keep_body`) its body, as sent (no decompression); ValueError
    for an answer too large, too slow or compressed."""
    deadline = time.monotonic() + ASK_DEADLINE_S
    with engine.stream("GET", path, headers={"Accept-Encoding": "identity", **headers}) as answer:
        if answer.headers.get("content-encoding", "identity").lower() != "identity":
            raise ValueError(f"{path}: a compressed answer")
        body = bytearray()
        if keep_body:
            for chunk in answer.iter_raw():
                body += chunk
                if len(body) > MAX_ANSWER_BYTES or time.monotonic() > deadline:
                    raise ValueError(f"{path}: an answer over {MAX_ANSWER_BYTES} bytes or {ASK_DEADLINE_S} s")
        return answer.status_code, bytes(body)


def _watched_lines(exposition: str) -> str:
    """The exposition's lines of the watched families only (their samples, TYPE and HELP): the
    parser's answer for them unchanged, at a tenth of the work (vLLM exposes some 90 families)."""
    def watched(line: str) -> bool:
        name = line.split(maxsplit=3)[2] if line.startswith("# ") and line.count(" ") >= 2 else line
        return name.startswith(WATCHED)

    return "\n".join(line for line in exposition.splitlines() if watched(line)) + "\n"


def _totals(exposition: str) -> dict[str, float]:
    """Each family's samples summed (over engines and labels), by family name."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(_watched_lines(exposition)):
        if family.name in BUSY or family.name in PROGRESS or family.name == KV_USE:
            totals[family.name] = sum(s.value for s in family.samples if not s.name.endswith("_created"))
    return totals


def kill(pid: int) -> None:
    """End the program's processes at once: its group (supervisord starts each program in its own)
    and any descendant that left it."""
    if pid <= 1:
        raise ValueError(f"refusing to kill process group {pid}")
    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for process in descendants:
        with contextlib.suppress(psutil.Error):
            process.kill()


Probe = Callable[[Program, str], Observation]


class Watchdog:
    """Looks at the engine replicas and the work queues (`check`). What it reads and does outside
    itself can be handed in: supervisord's client, the clock (seconds, monotonic), the look at a
    replica, the kill and the audit record; by default the real ones."""

    def __init__(self, settings: Settings, home: Home, *, supervisor: Supervisor | None = None,
                 clock: Callable[[], float] = time.monotonic, probe: Probe = observe,
                 kill: Callable[[int], None] = kill, announce: Callable[[Change], None] = announce) -> None:
        self.settings, self.home = settings, home
        self.supervisor = supervisor or Supervisor(home)
        self.clock, self.probe, self.kill, self.announce = clock, probe, kill, announce
        self.key = secret(home, "engine-api-key")
        self.replicas: dict[str, Replica] = {}
        self.heals = heals.load(home)

    def check(self) -> None:
        """One look at every engine replica, restarting those stalled (as the backoff allows), then
        at the work queues. A replica's restarts are remembered while it is one of the engines,
        whatever its state."""
        engines = {p.name: p for p in started_programs(self.home) if p.pool and p.socket and p.autostart}
        if not engines:
            log.warning("no engine replica to watch in %s", self.home.run)
        for gone in set(self.replicas) - set(engines):
            del self.replicas[gone]
        states = {info.name: info for info in self.supervisor.processes() if info.name in engines}
        for name, program in engines.items():
            try:
                self._look(program, states.get(name))
            except Exception:  # one replica's odd answer or state must not leave the others unwatched
                log.exception("looking at %s failed", name)
        try:
            end_stuck_workers(self.home, self.settings.watchdog, self.supervisor, self.kill, self._record)
        except Exception:  # supervisord restarting, say: the next look
            log.exception("looking at the work queues failed")

    def _look(self, program: Program, info: ProcessInfo | None) -> None:
        now = self.clock()
        replica = self.replicas.get(program.name)
        if replica is None:
            replica = self.replicas[program.name] = Replica(name=program.name, start_timeout_s=program.start_timeout_s,
                                                            started_at=now)
        if info is not None and info.state == ProcessState.FATAL:
            replica.pid = 0
            self._start_again(replica, program, now)
            return
        if info is None or info.state != ProcessState.RUNNING:
            replica.pid = 0  # starting, stopped or restarting: supervisord's business until it runs
            return
        if replica.pid != info.pid:  # first seen, or started again since the last look
            replica.pid, replica.started_at, replica.tokens, replica.kv_use = info.pid, now - info.uptime_s, None, None
            # Already past its start when first seen (the watchdog itself restarted): a whole stall
            # window from now, never judged on what happened before the watchdog looked.
            replica.progress_at = now if info.uptime_s >= program.start_timeout_s else None
        seen = self.probe(program, self.key)
        why = stall(replica, seen, now, self.settings.watchdog)
        if why is not None:
            self._restart(replica, program, why, Reason.NO_PROGRESS if seen.healthy else Reason.UNHEALTHY, now)

    def _restart(self, replica: Replica, program: Program, why: str, reason: Reason, now: float) -> None:
        if self._held_back(replica, why, now):
            return
        current = ProcessInfo.from_rpc(self.supervisor.call("getProcessInfo", replica.name))
        if current.state != ProcessState.RUNNING or current.pid != replica.pid:
            return  # it ended or was started again meanwhile: the pid is no longer the replica's
        number = self._count_restart(replica, program, reason, now)
        detail = f"pool {program.pool}: {why}; restart {number} (pid {replica.pid}); {self._next(replica)}"
        self.kill(replica.pid)  # supervisord starts it again; the router sets it aside until it answers
        replica.progress_at, replica.tokens, replica.kv_use = None, None, None
        self._record(Change("engine.restarted", "allowed", 0, Target(kind="engine", name=replica.name), detail,
                            actor=ACTOR))

    def _start_again(self, replica: Replica, program: Program, now: float) -> None:
        """supervisord gave up on the replica (FATAL): start it again, as its backoff allows, so a
        crash loop is retried ever more slowly instead of staying down for good."""
        why = "supervisord gave up on it (FATAL: it exited during each of its starts)"
        if self._held_back(replica, why, now):
            return
        # Counted first: a start supervisord refuses backs off like one that crashes.
        number = self._count_restart(replica, program, Reason.GAVE_UP, now)
        replica.progress_at, replica.tokens, replica.kv_use = None, None, None
        target = Target(kind="engine", name=replica.name)
        try:
            self.supervisor.call("startProcess", replica.name, False)
        except SupervisorError as exc:  # started meanwhile, or it cannot spawn: said, and tried after the backoff
            self._record(Change("engine.restarted", "error", 1, target, f"pool {program.pool}: {why}; start "
                                f"{number} refused: {exc.message}; {self._next(replica)}", actor=ACTOR))
            return
        self._record(Change("engine.restarted", "allowed", 0, target,
                            f"pool {program.pool}: {why}; start {number}; {self._next(replica)}", actor=ACTOR))

    def _held_back(self, replica: Replica, why: str, now: float) -> bool:
        """Whether the replica's backoff holds its next restart back (recorded once a backoff)."""
        if now >= replica.next_restart_at:
            return False
        if not replica.held_back:
            replica.held_back = True
            self._record(Change("engine.restart_held_back", "error", 1, Target(kind="engine", name=replica.name),
                                f"{why}; restart {replica.restarts + 1} held back "
                                f"{replica.next_restart_at - now:.0f} s more (backoff)", actor=ACTOR))
        return True

    def _count_restart(self, replica: Replica, program: Program, reason: Reason, now: float) -> int:
        """Count a restart against the backoff and in the heals' file (for the metrics); its number."""
        self.heals.count(replica.name, program.pool or "", reason)
        try:
            heals.save(self.home, self.heals)
        except OSError as exc:  # the restart stands; the count reaches the metrics with the next one
            log.error("the watchdog's restarts were not saved: %s", exc)
        replica.restarts += 1
        replica.next_restart_at = now + backoff_s(replica.restarts, self.settings.watchdog)
        replica.held_back = False
        log.warning("restarting %s (%s): restart %d", replica.name, reason, replica.restarts)
        return replica.restarts

    def _next(self, replica: Replica) -> str:
        return f"the next is allowed after {backoff_s(replica.restarts, self.settings.watchdog):.0f} s"

    def _record(self, change: Change) -> None:
        try:
            self.announce(change)
        except ApplianceError as exc:  # the restart stands; the record is retried by no one: say so loudly
            log.error("%s %s not recorded in the audit log: %s", change.action, change.target, exc.one_line())


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line for every look
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    home = Home.from_env()
    settings = load_settings(home.settings_file)
    watchdog = Watchdog(settings, home)
    while True:
        try:
            watchdog.check()
        except Exception:  # supervisord restarting, a state file mid-write: the next look; never a dead watchdog
            log.exception("check failed")
        time.sleep(settings.watchdog.check_interval_s)


if __name__ == "__main__":
    main()
