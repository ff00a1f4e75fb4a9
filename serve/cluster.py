"""The head's cluster listener and controller (`python -m serve.cluster`, supervised as `cluster`)
for pools whose plan spans hosts.

Workers join with their one-time token (appliance.hosts) over HTTPS from the appliance's CA,
receive their ranks' launch (built by the launcher's own `rank_command`) and pull the weights,
then report their ranks every `cluster.heartbeat_s`. vLLM's ranks of one pool form one
torch.distributed group, which does not survive the loss of any member: when a rank of the
current epoch exits, restarts or falls silent, the controller starts a new epoch at once (the
pool answers 503 from then on), stops the head's rank, waits until every worker has restarted
its ranks for the new epoch, and starts the head's rank again; each restart is audited.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import httpx
import uvicorn
from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse

from appliance.durable import replace_file
from appliance.engine_launch import Rank, engine_socket, python, rank_command, resolve_device
from appliance.errors import ApplianceError, Invalid
from appliance.home import HOME_ENV, Home
from appliance.hosts import (
    ClusterPoolState,
    Heartbeat,
    HeartbeatAnswer,
    JoinAnswer,
    JoinRequest,
    RankLaunch,
    RankView,
    Refused,
    WeightFile,
    WeightsReport,
    authenticate,
    check_token,
    cluster_state_file,
    redeem,
    refuse,
    worker_model_dir,
)
from appliance.model_refs import model_dir, served_name
from appliance.programs import Program
from appliance.records import STAGING_MANIFEST
from appliance.settings import Settings, load_settings
from appliance.staging_manifest import StagingManifest
from appliance.supervisor import ProcessState, Supervisor
from appliance.tls import ca_file, ensure_server_certificate
from audit.keys import signing_key
from audit.records import AuditEvent
from audit.writer import AuditWriter
from serve.engine import SpanningPool, spanning_pools
from serve.listener import GuardedHttpToolsProtocol
from serve.middleware import BodyLimitMiddleware

log = logging.getLogger("appliance.cluster")
TICK_S = 0.1
LIVE = (ProcessState.STARTING, ProcessState.RUNNING)
REFUSAL_SUMMARY_S = 10.0  # refusals: one audit record per source and action this often
REFUSAL_SOURCES = 1024
MAX_BODY_BYTES = 64 * 1024
JOIN_REFUSED = ("join refused: the token is wrong, used or expired, or names a host this head did not invite "
                "(the head's audit log says which)")


def cluster_programs(settings: Settings, home: Home) -> list[Program]:
    """The `cluster` program, where settings name a cluster address."""
    cluster = settings.cluster
    if cluster.bind is None:
        return []
    # Made now, so that `up` checks its health against the CA (the program reuses it).
    ensure_server_certificate(home, "cluster", (str(cluster.bind),))
    return [Program(
        name="cluster",
        command=[python(), "-P", "-m", "serve.cluster"],
        environment={HOME_ENV: str(home.root)},
        health_url=f"https://{_url_host(str(cluster.bind))}:{cluster.port}/cluster/healthz",
        urls={"cluster": f"https://{_url_host(str(cluster.bind))}:{cluster.port}"},
        priority=80, startsecs=2, stopwaitsecs=10, start_timeout_s=60,
    )]


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


# --- weights ---------------------------------------------------------------------------------------


def weights_dir(span: SpanningPool, home: Home, host: str) -> Path:
    """What a worker's ranks load: where the pool serves a subset staged for this plan
    (`appliance stage`: OUT/<host>/ per host), the worker's own subset beside the head's;
    else the pool's whole checkpoint."""
    directory = model_dir(span.pool, home)
    if not (directory / STAGING_MANIFEST).exists():
        return directory
    own = directory.parent / host
    manifest = StagingManifest.load(own) if (own / STAGING_MANIFEST).exists() else None
    if manifest is None or manifest.host != host or not manifest.complete:
        raise Invalid(f"pool {span.pool.name} serves a staged subset ({directory}), but {own} holds no complete "
                      f"subset staged for {host}", hint=f"appliance stage ... --plan PLAN --out {directory.parent} "
                      f"--host {host}")
    return own


def weight_files(directory: Path, known: dict[tuple[str, int, int], str] | None = None) -> list[WeightFile]:
    """Every regular file under `directory` (no links, nothing hidden) with its size and SHA-256;
    `known` keeps digests by (path, size, mtime) so that unchanged files are not read again."""
    files = []
    for path in sorted(directory.rglob("*")):
        relative = path.relative_to(directory).as_posix()
        if path.is_symlink() or not path.is_file() or any(part.startswith(".") for part in relative.split("/")):
            continue
        stat = path.stat()
        key = (relative, stat.st_size, stat.st_mtime_ns)
        if known is None or key not in known:
            digest = hashlib.sha256()
            with path.open("rb") as handle:
                while chunk := handle.read(1 << 20):
                    digest.update(chunk)
            if known is not None:
                known[key] = digest.hexdigest()
        files.append(WeightFile(path=relative, bytes=stat.st_size,
                                sha256=known[key] if known is not None else digest.hexdigest()))
    if not files:
        raise Invalid(f"{directory} holds no weights a worker can take (links are not followed: copy a "
                      "checkpoint made of links, such as a Hugging Face cache snapshot, into a directory first)")
    return files


# --- the controller ----------------------------------------------------------------------------


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

    def __init__(self, settings: Settings, home: Home, audit: Callable[[AuditEvent], None]) -> None:
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
                              client="cluster", source="head", resource=f"pool {control.span.pool.name}",
                              error=f"{why}; every rank restarts (epoch {control.epoch})"))

    def tick(self) -> None:
        processes = {info.name: info for info in self.supervisor.processes()}
        for name, control in self.pools.items():
            program = f"vllm-{name}"
            with self.lock:
                stop, control.stop_head = control.stop_head, False
            head = processes.get(program)
            if stop and head is not None and head.state in LIVE:
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
        elif control.head_pid is not None and (state not in LIVE or pid != control.head_pid):
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
        transport = httpx.HTTPTransport(uds=str(engine_socket(self.home, pool)))
        try:
            with httpx.Client(transport=transport, timeout=0.5) as client:
                return client.get("http://engine/health").status_code == 200
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
        replace_file(cluster_state_file(self.home, control.span.pool.name), state.model_dump_json().encode(),
                     mode=0o644)


# --- the HTTPS API ------------------------------------------------------------------------------


@dataclass
class Refusals:
    """Refusals of one source and action within REFUSAL_SUMMARY_S of the first (recorded itself)."""

    started: float
    last: AuditEvent
    count: int = 0  # after the first


def create_app(settings: Settings, home: Home) -> FastAPI:
    writer = AuditWriter(home.audit, signing_key(home), max_file_bytes=settings.audit.max_file_bytes)
    audit_lock = threading.Lock()
    refusals: dict[tuple[str, str], Refusals] = {}  # by (source, action)

    def audit(event: AuditEvent) -> None:
        with audit_lock:
            writer.append(event)

    controller = Controller(settings, home, audit)
    spans = controller.pools

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async def loop() -> None:
            while True:
                try:
                    await asyncio.to_thread(controller.tick)
                    await asyncio.to_thread(flush_refusals)
                except Exception:  # one failed tick (supervisord busy) must not end the controller
                    log.exception("cluster controller tick failed")
                await asyncio.sleep(TICK_S)

        task = asyncio.create_task(loop())
        yield
        task.cancel()
        writer.close()

    app = FastAPI(title="appliance cluster", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimitMiddleware, limit=MAX_BODY_BYTES)

    def source(request: Request) -> str:
        return request.client.host if request.client else "?"

    def event(action: str, outcome: Literal["allowed", "denied", "error"], status: int, request: Request,
              host: str, detail: str, error: str | None = None) -> AuditEvent:
        return AuditEvent(request_id=uuid.uuid4().hex, action=action, outcome=outcome,
                          status=status, subject=f"host:{host}", client="cluster", source=source(request),
                          resource=detail, error=error)

    def refused(action: str, status: int, request: Request, host: str, detail: str, why: str,
                told: str | None = None) -> HTTPException:
        """A refusal, audited: the first per source and action in each REFUSAL_SUMMARY_S has its own
        record, the others one summary record after the window (`flush_refusals`), and at most
        REFUSAL_SOURCES windows are open (a flood of bad tokens, under names of its choosing,
        cannot flood the log or the memory). The client is `told` less than the log says where the
        reason would tell it about others."""
        key, now = (source(request), action), time.monotonic()
        denied = event(action, "denied", status, request, host, detail, why)
        with audit_lock:
            if key not in refusals and len(refusals) >= REFUSAL_SOURCES:
                key = ("*", action)  # too many sources apart: the rest share one window
            window = refusals.get(key)
            counted = window is not None and now - window.started < REFUSAL_SUMMARY_S
            if window is not None and counted:
                window.count += 1
                window.last = denied
            else:
                refusals[key] = Refusals(now, denied)
        if window is not None and not counted and window.count:
            audit(summary(window))  # a closed window the flush has not reached yet
        if not counted:
            audit(denied)
        return HTTPException(status, told or why)

    def summary(window: Refusals) -> AuditEvent:
        return window.last.model_copy(update={
            "count": window.count, "error": f"{window.count} more refused; the last: {window.last.error}"})

    def flush_refusals() -> None:
        """One record for each closed window's refusals beyond its first, with the last reason."""
        now = time.monotonic()
        with audit_lock:
            closed = [key for key, window in refusals.items() if now - window.started >= REFUSAL_SUMMARY_S]
            summaries = [refusals.pop(key) for key in closed]
        for window in summaries:
            if window.count:
                audit(summary(window))

    def worker(request: Request, host: str, authorization: str) -> str:
        """The authenticated worker; 401 otherwise."""
        scheme, _, credential = authorization.partition(" ")
        try:
            if scheme.lower() != "bearer":
                raise Refused(f"host {host}: no bearer credential")
            return authenticate(home, host, credential).name
        except Refused as exc:
            raise refused("cluster.auth", 401, request, host, request.url.path, exc.message,
                          "unknown, revoked or refused host credential") from exc

    @app.exception_handler(Exception)
    async def fail_closed(_: Request, exc: Exception) -> JSONResponse:
        log.error("cluster request failed: %s", type(exc).__name__)
        return JSONResponse({"detail": "internal error"}, status_code=500)

    @app.get("/cluster/healthz")
    def healthz() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @app.get("/cluster/ca")
    def ca() -> PlainTextResponse:
        """The CA certificate (public): the joining worker checks it against its token's fingerprint."""
        return PlainTextResponse(ca_file(home).read_text())

    @app.post("/cluster/join")
    def join(body: JoinRequest, request: Request) -> JoinAnswer:
        pools = [(name, control.span) for name, control in spans.items() if body.name in control.span.workers]
        try:
            if not pools:
                raise Refused(f"no pool's plan runs on a host named {body.name}")
            device = resolve_device(settings.engine)
            if body.engine != device:
                raise Invalid(f"{body.name} runs the {body.engine} engine; the pool runs on {device}")
            check_token(home, body.name, body.secret)
            # Everything else that can fail comes before the token is spent: a failed join leaves it usable.
            ranks = [_launch(settings, home, span, body) for _, span in pools]
            credential = redeem(home, body.name, body.secret, str(body.address))
        except Refused as exc:
            raise refused("cluster.join", 401, request, body.name, "join", exc.message, JOIN_REFUSED) from exc
        except ApplianceError as exc:
            raise refused("cluster.join", 409, request, body.name, "join", exc.message) from exc
        audit(event("cluster.join", "allowed", 200, request, body.name,
                    f"joined as node {', '.join(f'{r.node} of pool {r.pool}' for r in ranks)}"))
        return JoinAnswer(credential=credential, heartbeat_s=settings.cluster.heartbeat_s, ranks=ranks)

    @app.get("/cluster/weights/{pool}/{path:path}")
    def weights(pool: str, path: str, request: Request, x_appliance_host: Annotated[str, Header()],
                authorization: Annotated[str, Header()] = "") -> FileResponse:
        host = worker(request, x_appliance_host, authorization)
        control = spans.get(pool)
        if control is None or host not in control.span.workers:
            raise HTTPException(404, f"pool {pool} has no rank on {host}")
        directory = weights_dir(control.span, home, host)
        listed = {f.path for f in weight_files(directory, digests)}
        target = directory / path
        # Listed a moment ago; served only if it is still a plain file inside the directory.
        if path not in listed or target.is_symlink() or not target.resolve().is_relative_to(directory.resolve()):
            raise HTTPException(404, f"{path}: not a file of pool {pool}'s weights")
        return FileResponse(target)

    @app.post("/cluster/weights-report")
    def weights_report(body: WeightsReport, request: Request, x_appliance_host: Annotated[str, Header()],
                       authorization: Annotated[str, Header()] = "") -> dict[str, bool]:
        host = worker(request, x_appliance_host, authorization)
        control = spans.get(body.pool)
        if control is None or host not in control.span.workers:
            raise HTTPException(404, f"pool {body.pool} has no rank on {host}")
        if body.problem is None:
            audit(event("cluster.weights", "allowed", 200, request, host, f"pool {body.pool}: every file verified"))
            return {"accepted": True}
        refuse(home, host, body.problem)
        audit(event("cluster.weights", "denied", 409, request, host, f"pool {body.pool}", body.problem))
        return {"accepted": False}

    @app.post("/cluster/heartbeat")
    def heartbeat(body: Heartbeat, request: Request, x_appliance_host: Annotated[str, Header()],
                  authorization: Annotated[str, Header()] = "") -> HeartbeatAnswer:
        return controller.heartbeat(worker(request, x_appliance_host, authorization), body)

    digests: dict[tuple[str, int, int], str] = {}

    def _launch(settings: Settings, home: Home, span: SpanningPool, body: JoinRequest) -> RankLaunch:
        node = span.workers.index(body.name) + 1
        local = worker_model_dir(body.home, span.pool.name)
        pool = span.pool.model_copy(update={"model": local, "served_model_name": served_name(span.pool, home),
                                            "plan": None})
        rank = Rank(node=node, head=str(settings.cluster.bind), gpus=tuple(span.plan.commands[node].gpus),
                    address=str(body.address), interface=body.interface, python=body.python)
        command = rank_command(pool, settings, Home(Path(body.home)), span.layout, body.engine, rank, host=body.name)
        return RankLaunch(pool=span.pool.name, node=node, argv=command.argv, env=command.env,
                          files=weight_files(weights_dir(span, home, body.name), digests))

    return app


def main() -> None:
    home = Home.from_env()
    settings = load_settings(home.settings_file)
    cluster = settings.cluster
    if cluster.bind is None:
        raise SystemExit("cluster.bind is not set")
    cert, key = ensure_server_certificate(home, "cluster", (str(cluster.bind),))
    # The gateway's guard: slow or endless header senders and connection floods are cut off.
    GuardedHttpToolsProtocol.header_timeout_s = settings.gateway.header_timeout_s
    GuardedHttpToolsProtocol.max_connections = 256
    uvicorn.run(create_app(settings, home), host=str(cluster.bind), port=cluster.port, ssl_certfile=str(cert),
                ssl_keyfile=str(key), http=GuardedHttpToolsProtocol, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
