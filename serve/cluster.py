"""The head's cluster listener (`python -m serve.cluster`, supervised as `cluster`) for pools
whose plan spans hosts: workers join with their one-time token (appliance.hosts) over HTTPS from
the appliance's CA, receive their ranks' launch (built by the launcher's own `rank_command`),
pull the weights, then report their ranks every `cluster.heartbeat_s` to the controller
(serve.cluster_controller), which runs in this process too. Joins, weight checks and refusals
are audited.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import uvicorn
from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse

from appliance.digest import sha256_file
from appliance.engine_launch import Rank, python, rank_command, resolve_device
from appliance.errors import ApplianceError, Invalid
from appliance.home import HOME_ENV, Home
from appliance.hosts import (
    Heartbeat,
    HeartbeatAnswer,
    JoinAnswer,
    JoinRequest,
    RankLaunch,
    Refused,
    WeightFile,
    WeightsReport,
    authenticate,
    check_token,
    redeem,
    refuse,
    worker_model_dir,
)
from appliance.model_refs import model_dir, served_name
from appliance.programs import Program
from appliance.records import STAGING_MANIFEST
from appliance.settings import Settings, load_settings
from appliance.staging_manifest import StagingManifest
from appliance.tls import ca_file, ensure_server_certificate
from audit.keys import signing_key
from audit.records import AuditEvent
from audit.writer import AuditWriter
from serve.cluster_controller import TICK_S, Controller
from serve.engine import SpanningPool
from serve.listener import GuardedHttpToolsProtocol
from serve.middleware import BodyLimitMiddleware

log = logging.getLogger("appliance.cluster")
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
        digest = known.get(key) if known is not None else None
        if digest is None:
            digest = sha256_file(path)
            if known is not None:
                known[key] = digest
        files.append(WeightFile(path=relative, bytes=stat.st_size, sha256=digest))
    if not files:
        raise Invalid(f"{directory} holds no weights a worker can take (links are not followed: copy a "
                      "checkpoint made of links, such as a Hugging Face cache snapshot, into a directory first)")
    return files


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
        log.error("cluster request failed", exc_info=exc)
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
            ranks = [_launch(span, body) for _, span in pools]
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
        try:
            directory = weights_dir(control.span, home, host)
            listed = {f.path for f in weight_files(directory, digests)}
        except ApplianceError as exc:
            raise HTTPException(409, exc.message) from exc
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

    def _launch(span: SpanningPool, body: JoinRequest) -> RankLaunch:
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
