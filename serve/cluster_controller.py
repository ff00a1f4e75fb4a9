"""The controller of pools spanning hosts, inside the head's `cluster` program (serve.cluster).

vLLM's ranks of one pool form one torch.distributed group, which does not survive the loss of any
member: when a rank of the current epoch exits, restarts or falls silent, the controller starts a
new epoch at once (the pool's state file says not ready, so the gateway answers 503), stops the
head's rank, waits until every worker has restarted its ranks for the new epoch (their agents
learn it from the heartbeat's answer), and starts the head's rank again; each restart is audited.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from appliance.changes import Target
from appliance.durable import replace_file
from appliance.engine_launch import engine_program, engine_socket
from appliance.home import Home
from appliance.hosts import ClusterPoolState, Heartbeat, HeartbeatAnswer, RankView, cluster_state_file
from appliance.settings import Settings
from appliance.supervisor import LIVE_STATES, ProcessState, Supervisor
from appliance.unix_http import unix_transport
from audit.records import AuditEvent
from serve.engine import ENGINE_BASE_URL, SpanningPool, spanning_pools

TICK_S = 0.1


@dataclass
class PoolControl:
    span: SpanningPool
    epoch: int = 1
    acked: dict[str, int] = field(default_factory=dict)  # worker -> its rank's pid in this epoch
    reports: dict[str, tuple[float, bool, int, int]] = field(default_factory=dict)  # seen, running, pid, epoch
    head_pid: int | None = None  # the head rank's pid in this epoch, once started
    stop_head: bool = False
    ready: bool = False
    why: str = "waiting for workers"
    failures: int = 0  # epochs failed since it last served: the head's next start waits 2^(n-1) s, at most 60
    start_after: float = 0.0


class Controller:
    """Keeps each spanning pool's ranks in one epoch, and its state file current.

    Heartbeats arrive on request threads and `tick` runs on another: every change of a pool's
    record happens under `lock`, and what `tick` decides outside it (starting the head's rank,
    declaring the pool ready) is applied only if the epoch did not change meanwhile."""

    def __init__(self, settings: Settings, home: Home, audit: Callable[[AuditEvent], object]) -> None:
        self.settings = settings
        self.home = home
        self.audit = audit
        self.supervisor = Supervisor(home)
        self.pools = {name: PoolControl(span) for name, span in spanning_pools(settings).items()}
        self.lock = threading.Lock()
        (home.run / "cluster").mkdir(mode=0o700, exist_ok=True)
        for control in self.pools.values():
            self._write(control)

    def heartbeat(self, host: str, beat: Heartbeat) -> HeartbeatAnswer:
        now = time.monotonic()
        with self.lock:
            seen: set[str] = set()
            for report in beat.ranks:
                control = self.pools.get(report.pool)
                if control is None or host not in control.span.workers or report.pool in seen:
                    continue  # not its pool, or a second report of one: one report per pool counts
                seen.add(report.pool)
                control.reports[host] = (now, report.running, report.pid, report.epoch)
                if report.epoch != control.epoch:
                    continue  # restarting for the current epoch: not yet part of it
                pid = control.acked.get(host)
                if pid is None and report.running and report.pid:
                    control.acked[host] = report.pid
                elif pid is not None and (not report.running or report.pid != pid):
                    self._fail(control, f"the rank on {host} exited (pid {pid})")
            return HeartbeatAnswer(epochs={name: control.epoch for name, control in self.pools.items()})

    def _fail(self, control: PoolControl, why: str) -> None:
        """A rank of the current epoch is gone: a new epoch, the pool unready at once."""
        control.epoch += 1
        control.acked.clear()
        control.stop_head = control.head_pid is not None
        control.head_pid = None
        control.ready = False
        control.failures += 1
        control.start_after = time.monotonic() + min(60.0, 2.0 ** (control.failures - 1))
        control.why = f"restarting: {why}"
        self._write(control)
        self.audit(AuditEvent(request_id=uuid.uuid4().hex, action="cluster.restart", outcome="error", status=503,
                              client="cluster", source="head", resource="cluster",
                              target=Target(kind="pool", name=control.span.pool.name), reason="rank_exited",
                              error=f"{why}; every rank restarts (epoch {control.epoch})"))

    def tick(self) -> None:
        processes = {info.name: info for info in self.supervisor.processes()}
        for name, control in self.pools.items():
            program = engine_program(name)
            with self.lock:
                stop, control.stop_head = control.stop_head, False
            head = processes.get(program)
            if stop and head is not None and head.state in LIVE_STATES:
                self.supervisor.call("stopProcess", program, True)
                head = None
            with self.lock:
                self._check(control, head.state if head else ProcessState.STOPPED, head.pid if head else 0)
                epoch = control.epoch
                start = (control.head_pid is None and self._all_acked(control) and not control.stop_head
                         and time.monotonic() >= control.start_after)
            if start:
                self.supervisor.call("startProcess", program, False)
                info = next((i for i in self.supervisor.processes() if i.name == program), None)
                with self.lock:
                    if control.epoch == epoch and info is not None and info.pid:
                        control.head_pid = info.pid
                        control.why = "starting the head's rank"
                    else:
                        control.stop_head = True  # the epoch failed meanwhile: this start is not part of it
            with self.lock:
                candidate = control.head_pid is not None and self._all_acked(control)
            answers = candidate and self._engine_answers(name)
            with self.lock:
                if control.epoch == epoch and answers != control.ready:
                    control.ready = answers
                    if answers:
                        control.failures, control.why = 0, "serving"
                    else:
                        control.why = "the head's engine does not answer /health"
                self._write(control)

    def _check(self, control: PoolControl, state: ProcessState, pid: int) -> None:
        """Fail the epoch when a member is gone: a worker that acknowledged it and fell silent, any
        silent worker once the head's rank runs, or the head's rank itself."""
        now, dead_after = time.monotonic(), self.settings.cluster.dead_after_s
        silent = [host for host in control.span.workers
                  if now - control.reports.get(host, (-math.inf, False, 0, 0))[0] > dead_after]
        lost = [host for host in silent if host in control.acked or control.head_pid is not None]
        if lost:
            self._fail(control, f"{lost[0]} sent no heartbeat for {dead_after:g} s")
        elif control.head_pid is not None and (state not in LIVE_STATES or pid != control.head_pid):
            self._fail(control, f"the head's rank exited (pid {control.head_pid})")
        elif not control.ready and control.head_pid is None:
            missing = [host for host in control.span.workers if host not in control.acked]
            if missing:
                control.why = f"waiting for {', '.join(missing)}"
            elif now < control.start_after:
                control.why = f"restarting in {control.start_after - now:.0f} s (after {control.failures} failures)"

    def _all_acked(self, control: PoolControl) -> bool:
        return all(host in control.acked for host in control.span.workers)

    def _engine_answers(self, pool: str) -> bool:
        transport = unix_transport(engine_socket(self.home, pool))
        try:
            with httpx.Client(transport=transport, timeout=0.5) as client:
                return client.get(f"{ENGINE_BASE_URL}/health").status_code == 200
        except httpx.HTTPError:
            return False

    def _write(self, control: PoolControl) -> None:
        now = time.monotonic()
        ranks = [RankView(host="head", node=0, running=control.head_pid is not None, pid=control.head_pid or 0,
                          epoch=control.epoch)]
        for node, host in enumerate(control.span.workers, start=1):
            seen, running, pid, epoch = control.reports.get(host, (math.nan, False, 0, 0))
            ranks.append(RankView(host=host, node=node, running=running, pid=pid, epoch=epoch,
                                  seen_s_ago=None if math.isnan(seen) else round(now - seen, 2)))
        state = ClusterPoolState(pool=control.span.pool.name, epoch=control.epoch, ready=control.ready,
                                 why=control.why, ranks=ranks)
        replace_file(cluster_state_file(self.home, control.span.pool.name), state.model_dump_json().encode())
