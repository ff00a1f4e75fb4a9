"""The routes of the head's cluster listener (/cluster/*): workers join with their one-time token,
take their ranks' weights, report whether those verified, and send heartbeats. Joins, weight
checks and refusals are audited; refusals are summarised per source and action (serve.summaries)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, Header, HTTPException, Request
from fastapi.responses import FileResponse, PlainTextResponse

from appliance import training_launches
from appliance.changes import Outcome, Target
from appliance.engine_launch import Rank, rank_command, resolve_device
from appliance.errors import ApplianceError, Invalid
from appliance.home import Home
from appliance.hosts import (
    Heartbeat,
    HeartbeatAnswer,
    JoinAnswer,
    JoinRequest,
    RankLaunch,
    Refused,
    WeightsReport,
    authenticate,
    check_token,
    redeem,
    refuse,
    worker_model_dir,
)
from appliance.jobs import HostPart, record_part
from appliance.model_refs import served_name
from appliance.settings import Settings
from appliance.tls import ca_file
from appliance.training_launches import TrainingLaunch
from audit.records import AuditEvent
from audit.writer import AuditWriter
from serve.cluster_controller import Controller
from serve.cluster_weights import WeightService
from serve.engine import SpanningPool
from serve.summaries import Summaries, cap_text

JOIN_REFUSED = ("join refused: the token is wrong, used or expired, or names a host this head did not invite "
                "(the head's audit log says which)")


def cluster_event(action: str, outcome: Outcome, status: int, request: Request,
                  host: str, detail: str, error: str | None = None) -> AuditEvent:
    """The audit record of a request to the cluster listener, on behalf of `host`."""
    return AuditEvent(request_id=uuid.uuid4().hex, action=action, outcome=outcome, status=status,
                      subject=f"host:{host}", client="cluster", source=request.client.host if request.client else "?",
                      resource=cap_text(request.url.path), target=Target(kind="host", name=cap_text(host)),
                      detail=cap_text(detail), reason=None if outcome == "allowed" else f"http_{status}", error=error)


def record_refusal(writer: AuditWriter, refusals: Summaries, denied: AuditEvent) -> None:
    """Write `denied` if it is its source's first refusal of its action in the interval; the
    others are counted into one summary record that keeps the last reason (a flood of bad
    tokens, under names of its choosing, can flood neither the log nor the memory)."""
    if refusals.first_of_interval(denied, denied.action):
        writer.append(denied)


def rank_launch(settings: Settings, home: Home, weights: WeightService, span: SpanningPool,
                body: JoinRequest) -> RankLaunch:
    """How the joining worker starts its rank of `span`, and the weights it loads."""
    node = span.workers.index(body.name) + 1
    local = worker_model_dir(body.home, span.pool.name)
    pool = span.pool.model_copy(update={"model": local, "served_model_name": served_name(span.pool, home),
                                        "plan": None})
    rank = Rank(node=node, head=str(settings.cluster.bind), gpus=tuple(span.plan.commands[node].gpus),
                address=str(body.address), interface=body.interface, python=body.python)
    command = rank_command(pool, settings, Home(Path(body.home)), span.layout, body.engine, rank, host=body.name)
    return RankLaunch(pool=span.pool.name, node=node, argv=command.argv, env=command.env,
                      files=weights.listing(span, body.name))


def router(settings: Settings, home: Home, controller: Controller, weights: WeightService, writer: AuditWriter,
           refusals: Summaries) -> APIRouter:
    routes = APIRouter(prefix="/cluster")
    spans = controller.pools

    def refused(action: str, status: int, request: Request, host: str, detail: str, why: str,
                told: str | None = None) -> HTTPException:
        """A refusal, audited (`record_refusal`). The client is `told` less than the log says where
        the reason would tell it about others."""
        record_refusal(writer, refusals, cluster_event(action, "denied", status, request, host, detail, why))
        return HTTPException(status, told or why)

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

    @routes.get("/healthz")
    def healthz() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @routes.get("/ca")
    def ca() -> PlainTextResponse:
        """The CA certificate (public): the joining worker checks it against its token's fingerprint."""
        return PlainTextResponse(ca_file(home).read_text())

    @routes.post("/join")
    def join(body: JoinRequest, request: Request) -> JoinAnswer:
        pools = [control.span for control in spans.values() if body.name in control.span.workers]
        try:
            if not pools:
                raise Refused(f"no pool's plan runs on a host named {body.name}")
            device = resolve_device(settings.engine)
            if body.engine != device:
                raise Invalid(f"{body.name} runs the {body.engine} engine; the pool runs on {device}")
            check_token(home, body.name, body.secret)
            # Everything else that can fail comes before the token is spent: a failed join leaves it usable.
            ranks = [rank_launch(settings, home, weights, span, body) for span in pools]
            credential = redeem(home, body.name, body.secret, str(body.address))
        except Refused as exc:
            raise refused("cluster.join", 401, request, body.name, "join", exc.message, JOIN_REFUSED) from exc
        except ApplianceError as exc:
            raise refused("cluster.join", 409, request, body.name, "join", exc.message) from exc
        writer.append(cluster_event("cluster.join", "allowed", 200, request, body.name,
                                    f"joined as node {', '.join(f'{r.node} of pool {r.pool}' for r in ranks)}"))
        return JoinAnswer(credential=credential, heartbeat_s=settings.cluster.heartbeat_s, ranks=ranks)

    @routes.get("/weights/{pool}/{path:path}")
    def weight(pool: str, path: str, request: Request, x_appliance_host: Annotated[str, Header()],
               authorization: Annotated[str, Header()] = "") -> FileResponse:
        host = worker(request, x_appliance_host, authorization)
        control = spans.get(pool)
        if control is None or host not in control.span.workers:
            raise HTTPException(404, f"pool {pool} has no rank on {host}")
        try:
            target = weights.file(control.span, host, path)
        except ApplianceError as exc:
            raise HTTPException(409, exc.message) from exc
        if target is None:
            raise HTTPException(404, f"{path}: not a file of pool {pool}'s weights")
        return FileResponse(target)

    @routes.post("/weights-report")
    def weights_report(body: WeightsReport, request: Request, x_appliance_host: Annotated[str, Header()],
                       authorization: Annotated[str, Header()] = "") -> dict[str, bool]:
        host = worker(request, x_appliance_host, authorization)
        control = spans.get(body.pool)
        if control is None or host not in control.span.workers:
            raise HTTPException(404, f"pool {body.pool} has no rank on {host}")
        if body.problem is None:
            writer.append(cluster_event("cluster.weights", "allowed", 200, request, host,
                                        f"pool {body.pool}: every file verified"))
            return {"accepted": True}
        refuse(home, host, body.problem)
        writer.append(cluster_event("cluster.weights", "denied", 409, request, host, f"pool {body.pool}",
                                    body.problem))
        return {"accepted": False}

    @routes.get("/training")
    def training(request: Request, x_appliance_host: Annotated[str, Header()],
                 authorization: Annotated[str, Header()] = "") -> list[TrainingLaunch]:
        """The training jobs this host has a part in (finetune.cluster_node runs them)."""
        host = worker(request, x_appliance_host, authorization)
        return [found.launch for found in training_launches.published(home, host)]

    @routes.get("/training/{job}/{kind}/{path:path}")
    def training_file(job: int, kind: Literal["job", "base"], path: str, request: Request,
                      x_appliance_host: Annotated[str, Header()],
                      authorization: Annotated[str, Header()] = "") -> FileResponse:
        host = worker(request, x_appliance_host, authorization)
        target = training_launches.file_of(home, host, job, kind, path)
        if target is None:
            raise HTTPException(404, f"{kind} file {path}: not in a training launch of job {job} for {host}")
        return FileResponse(target)

    @routes.post("/training/report")
    def training_report(body: HostPart, request: Request, x_appliance_host: Annotated[str, Header()],
                        authorization: Annotated[str, Header()] = "") -> dict[str, bool]:
        host = worker(request, x_appliance_host, authorization)
        if not training_launches.has_part(home, host, body.job, body.node):
            raise HTTPException(404, f"job {body.job} has no part {body.node} on {host}")
        record_part(home, host, body)
        return {"accepted": True}

    @routes.post("/heartbeat")
    def heartbeat(body: Heartbeat, request: Request, x_appliance_host: Annotated[str, Header()],
                  authorization: Annotated[str, Header()] = "") -> HeartbeatAnswer:
        return controller.heartbeat(worker(request, x_appliance_host, authorization), body)

    return routes
