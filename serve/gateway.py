"""The gateway: an authenticated, rate-limited, metered OpenAI-compatible front for the engines.

`create_app(settings, home)` composes it: the middleware (serve.middleware, serve.audit_trail),
the exception handlers (serve.error_handlers), the routes (serve.routes) and the lifespan that owns
its clients and background tasks (serve.lifespan); supervisord runs `app_from_env` under uvicorn.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI

from appliance.errors import ApplianceError
from appliance.home import Home
from appliance.roles import Role
from appliance.settings import Settings, load_settings
from audit import AuditWriter, TextHasher, signing_key
from serve.audit_trail import AuditMiddleware
from serve.dependencies import DependencyProbes
from serve.engine import spanning_pools
from serve.error_handlers import ERROR_HANDLERS
from serve.gateway_records import AuditSummaries
from serve.identity_proxy import router as identity_router
from serve.lifespan import lifespan
from serve.metrics import (
    ClusterCollector,
    GpuCollector,
    Metrics,
    ProgramCollector,
    QueueCollector,
    Reused,
    StateCollector,
)
from serve.middleware import AuthenticateFirst, BodyLimitMiddleware, MeterMiddleware
from serve.relay import after_record
from serve.routes import admin_routers, health, v1

log = logging.getLogger("appliance.gateway")
# Every route under these prefixes needs a token and one of these roles (each route checks its
# own exactly): callers are refused on their headers, before their bodies are read.
# The first prefix a path starts with applies: a user manages their own API keys.
ROLES_UNDER: dict[str, frozenset[str]] = {"/v1/": frozenset({Role.USER, Role.ADMIN}),
                                          "/admin/keys": frozenset({Role.USER, Role.ADMIN}),
                                          "/admin/": frozenset({Role.ADMIN, Role.AUDITOR})}


def create_app(settings: Settings, home: Home) -> FastAPI:
    """The gateway app for these settings; HTTP clients live as long as the app."""
    audit = settings.audit
    metrics = Metrics()
    writer = AuditWriter(home.audit, signing_key(home), checkpoint_every=audit.checkpoint_every,
                         checkpoint_interval_s=audit.checkpoint_interval_s,
                         max_file_bytes=audit.max_file_bytes)
    dependencies = DependencyProbes(home)
    _collect(metrics, settings, home, writer, dependencies)
    summaries = AuditSummaries.from_settings(audit)
    app = FastAPI(title="appliance gateway", version="1", exception_handlers=ERROR_HANDLERS,
                  lifespan=lifespan(settings, home, metrics, writer, dependencies, summaries))
    app.state.audit = writer
    app.state.home = home
    # A multipart upload carries its file and a little framing.
    app.add_middleware(BodyLimitMiddleware, limit=settings.gateway.max_body_bytes,
                       paths={"/v1/files": settings.batch.max_file_bytes + 64 * 1024})
    app.add_middleware(AuthenticateFirst, needs=ROLES_UNDER)  # inside the audit: refusals are recorded
    app.add_middleware(AuditMiddleware, writer=writer, hasher=TextHasher(home), capture_text=audit.capture_text,
                       refusals=summaries.refusals, monitoring=summaries.monitoring,
                       count_repeated_reads=audit.count_repeated_reads, after_record=after_record(app))
    app.add_middleware(MeterMiddleware, metrics=metrics)  # outermost: opens each request's context, counts 413s too
    # The /v1 routes before the rest: routes are matched in order, and /v1 carries the traffic.
    for router in [health.router(home), v1.router(), *admin_routers(settings, home), identity_router(settings)]:
        app.include_router(router)
    return app


def _collect(metrics: Metrics, settings: Settings, home: Home, writer: AuditWriter,
             dependencies: DependencyProbes) -> None:
    """Register the collectors /metrics reads beside the gateway's own counters."""
    metrics.registry.register(StateCollector(home, writer, settings.gateway.certificate))
    metrics.registry.register(Reused(QueueCollector(home)))
    metrics.registry.register(Reused(ProgramCollector(home)))
    metrics.registry.register(dependencies)
    metrics.registry.register(ClusterCollector(home, _spanning(settings)))
    metrics.registry.register(Reused(GpuCollector(home, settings.monitoring.nvml_library)))


def _spanning(settings: Settings) -> list[str]:
    """The pools planned across hosts (their state in /metrics); none if a plan cannot be read now
    (the engines say why)."""
    try:
        return list(spanning_pools(settings))
    except ApplianceError as exc:
        log.warning("pools spanning hosts not in /metrics: %s", exc.one_line())
        return []


def app_from_env() -> FastAPI:
    """The supervised gateway's factory: settings and secrets from APPLIANCE_HOME."""
    home = Home.from_env()
    settings = load_settings(home.settings_file)
    return create_app(settings, home)
