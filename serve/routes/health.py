"""/healthz, /readyz and the metrics: the gateway's own (/metrics, for the monitoring password or an
administrator's token) and its engines' (/metrics/engines, for the monitoring password only)."""

from __future__ import annotations

import base64
import hmac
import time
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from appliance.alerts import MONITORING_SECRET, MONITORING_USER
from appliance.api_keys import looks_like_key
from appliance.home import Home
from appliance.roles import Role
from appliance.secrets import secret
from serve.auth import Principal
from serve.errors import AuthError
from serve.lifespan import Gateway

READY_CACHE_S = 1.0  # /readyz is anonymous: its engine checks run at most this often


class Health(BaseModel):
    status: str
    checks: dict[str, bool] = {}
    reason: str | None = None


def router(home: Home) -> APIRouter:
    routes = APIRouter(tags=["health"])

    @routes.get("/healthz", response_model=Health)
    async def healthz() -> Health:
        """The gateway process is alive."""
        return Health(status="ok")

    ready: dict[str, Any] = {"at": float("-inf"), "body": None}
    ready_lock = anyio.Lock()

    @routes.get("/readyz", response_model=Health,
                responses={503: {"model": Health, "description": "An engine, the signing keys or the audit log "
                                                                 "is not available."}})
    async def readyz(request: Request) -> Any:
        """Ready when every pool has a replica answering its health check, the realm's signing keys
        are loaded and the audit log is writable. Anonymous: it changes nothing (no key refetch), runs its engine
        checks at most once a second, and names no replica, file or OS error (the gateway's log does)."""
        gateway: Gateway = request.app.state.gateway
        async with ready_lock:  # callers arriving during a check share its result
            if time.monotonic() - ready["at"] >= READY_CACHE_S:
                healthy = {replica.name: await gateway.upstreams.replicas.healthy(replica)
                           for pool in gateway.upstreams.pools for replica in pool.replicas}
                # A pool serves while one of its replicas does; the others are routed around. Which
                # replica is down is for administrators (/metrics, `appliance status`), not anonymous callers.
                checks = {"engines": all(any(healthy[replica.name] for replica in pool.replicas)
                                         for pool in gateway.upstreams.pools)}
                checks["jwks"] = gateway.validator.has_keys
                checks["audit"] = request.app.state.audit.check() is None
                ok = all(checks.values())
                ready["body"] = Health(status="ready" if ok else "not ready", checks=checks,
                                       reason=None if checks["audit"] else "audit log not writable")
                ready["at"] = time.monotonic()
        body: Health = ready["body"]
        return JSONResponse(body.model_dump(), status_code=200 if body.status == "ready" else 503)

    # One scrape at a time, in a thread of its own: collectors read databases, the disk and NVML,
    # and a flood of scrapes must not take the threads the rest of the gateway works in.
    scrapes = anyio.CapacityLimiter(1)

    # What the appliance's Prometheus sends: the monitoring password (appliance.alerts).
    monitoring_credential = "Basic " + base64.b64encode(
        f"{MONITORING_USER}:{secret(home, MONITORING_SECRET)}".encode()).decode()

    @routes.get("/metrics", response_class=Response)
    async def prometheus(request: Request) -> Response:
        """Prometheus metrics of the gateway, for the monitoring password (the appliance's own
        Prometheus, or yours) or an administrator's token (the TUI): they name GPUs, queues and
        adapters."""
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(errors="replace"), monitoring_credential.encode()):
            await administrator(request, given)
        body = await anyio.to_thread.run_sync(generate_latest, request.app.state.gateway.metrics.registry,
                                              limiter=scrapes)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @routes.get("/metrics/engines", response_class=Response)
    async def engines_prometheus(request: Request) -> Response:
        """The engines' own metrics (vLLM's), each replica's labelled with its pool, replica and tier;
        for the appliance's Prometheus only (its password), since each scrape reaches every engine."""
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(errors="replace"), monitoring_credential.encode()):
            return Response("the monitoring password is needed\n", status_code=401,
                            headers={"WWW-Authenticate": 'Basic realm="appliance monitoring"'})
        return Response(await request.app.state.gateway.upstreams.engine_metrics(), media_type=CONTENT_TYPE_LATEST)

    return routes


async def administrator(request: Request, authorization: str) -> Principal:
    """The caller of a route outside /admin that only administrators may use, from a bearer token
    (never an API key): AuthError (401, 403) otherwise, counted like any refused token."""
    gateway: Gateway = request.app.state.gateway
    try:
        if looks_like_key(authorization.partition(" ")[2].strip()):
            raise AuthError("key_not_allowed", "API keys cannot read the gateway's metrics; use the monitoring "
                            "password or an administrator's login", status=403)
        who = await gateway.validator.validate(authorization or None)
        if Role.ADMIN not in who.roles:
            raise AuthError("missing_role", "the 'admin' role is required", status=403)
    except AuthError as exc:
        gateway.metrics.auth_failures.labels(exc.reason).inc()
        raise
    return who
