"""The gateway: an authenticated, rate-limited, metered OpenAI-compatible front for the engines.

`create_app(settings, home)` builds it; supervisord runs `app_from_env` under uvicorn.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gc
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, cast

import aiohttp
import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from appliance.adapters import AdapterRecord
from appliance.alerts import MONITORING_SECRET, MONITORING_USER
from appliance.api_keys import looks_like_key
from appliance.api_keys import ref as key_ref
from appliance.artifacts import artifact_store
from appliance.changes import Target
from appliance.errors import ApplianceError, Conflict, NotFound
from appliance.home import Home
from appliance.roles import Role
from appliance.secrets import gateway_client_secret, secret
from appliance.settings import Settings, load_settings
from appliance.tls import keycloak_ssl
from appliance.users import Users
from audit import AuditEvent, AuditUnavailable, AuditWriter, TextHasher, archive, signing_key
from serve.adapters import AdapterRoutes, base_configs
from serve.answer import Answer, decode_json
from serve.api_keys import KeyAuthenticator
from serve.audit_trail import AuditMiddleware, Transcript, note_target
from serve.auth import Introspector, Principal, TokenValidator
from serve.canary import Ended
from serve.compliance import AnswerFilter, Compliance, Marks
from serve.dependencies import DependencyProbes
from serve.deps import ChatUser
from serve.engine import ENGINE_KEY_SECRET, spanning_pools
from serve.errors import AuthError, GatewayError, ModelNotFound, from_core, validation_error
from serve.identity_proxy import IdentityProxy
from serve.identity_proxy import router as identity_router
from serve.keycloak_events import KeycloakEvents
from serve.keycloak_http import keycloak_client
from serve.limits import Admission, RateLimiter
from serve.metrics import (
    ClusterCollector,
    GpuCollector,
    Metrics,
    ProgramCollector,
    QueueCollector,
    Reused,
    StateCollector,
)
from serve.middleware import AuthenticateFirst, BodyLimitMiddleware, MeterMiddleware, RequestTooLarge
from serve.replicas import Pool, engine_session, pools_from_settings
from serve.response_cache import CachedAnswer, Capture, ResponseCache, deterministic, wants
from serve.routes import admin_routers
from serve.schemas import ChatRequest, CompletionRequest, FeedbackRequest
from serve.slow_clients import SlowClients
from serve.sse_relay import relay_stream, usage_of
from serve.summaries import Refusals, Summaries, write_due
from serve.upstream import Upstreams, read_answer

log = logging.getLogger("appliance.gateway")
# Monitoring routes need role admin, so their readers are few; past this many in one interval the
# rest are summarised together (user "*").
MONITORING_USERS = 64
# Every route under these prefixes needs a token and one of these roles (each route checks its
# own exactly): callers are refused on their headers, before their bodies are read.
# The first prefix a path starts with applies: a user manages their own API keys.
ROLES_UNDER: dict[str, frozenset[str]] = {"/v1/": frozenset({Role.USER, Role.ADMIN}),
                                          "/admin/keys": frozenset({Role.USER, Role.ADMIN}),
                                          "/admin/": frozenset({Role.ADMIN, Role.AUDITOR})}
READY_CACHE_S = 1.0  # /readyz is anonymous: its engine checks run at most this often
KEYS_RETRY_S = 5.0


@dataclass
class Gateway:
    """Everything a request handler needs; owned by the app's lifespan."""

    settings: Settings
    validator: TokenValidator
    upstreams: Upstreams
    limiter: RateLimiter
    metrics: Metrics
    adapters: AdapterRoutes
    compliance: Compliance
    cache: ResponseCache
    keys: KeyAuthenticator
    identity: IdentityProxy | None  # Keycloak's login endpoints, when published (serve.identity_proxy)


class Health(BaseModel):
    status: str
    checks: dict[str, bool] = {}
    reason: str | None = None


def create_app(settings: Settings, home: Home) -> FastAPI:
    """The gateway app for these settings; HTTP clients live as long as the app."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        connect_s = settings.gateway.upstream_connect_timeout_s
        engine_timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_s)  # generation takes long
        pools = pools_from_settings(settings, home)
        compliance = Compliance(settings.compliance)  # a policy naming an unknown kind stops the start here
        keycloak_trust = keycloak_ssl(settings, home)
        async with (keycloak_client(keycloak_trust, connect_s) as http,  # keys, introspection, events
                    contextlib.AsyncExitStack() as stack):
            engines = {replica.name: await stack.enter_async_context(engine_session(replica, engine_timeout))
                       for pool in pools for replica in pool.replicas}
            keycloak = settings.keycloak
            introspect = None
            if settings.gateway.introspect_ttl_s > 0:
                introspect = Introspector(issuer=keycloak.issuer, realm_url=keycloak.realm_url,
                                          client_id=keycloak.gateway_client_id,
                                          client_secret=gateway_client_secret(settings, home),
                                          http=http, ttl_s=settings.gateway.introspect_ttl_s)
            validator = TokenValidator(issuer=keycloak.issuer, realm_url=keycloak.realm_url,
                                       audience=keycloak.gateway_client_id,
                                       http=http, leeway_s=settings.gateway.leeway_s,
                                       refetch_interval_s=settings.gateway.jwks_refetch_interval_s,
                                       introspect=introspect, on_fetch=metrics.jwks_fetches.inc)
            upstreams = Upstreams(pools, engines, secret(home, ENGINE_KEY_SECRET), settings.routing, metrics)
            cache = ResponseCache(settings.cache, metrics)
            identity = None
            if keycloak.frontend_url:  # a client of its own: logins never hold the connections keys are fetched on
                identity = IdentityProxy(settings, await stack.enter_async_context(keycloak_client(
                    keycloak_trust, connect_s)), _refusal_recorder(writer, refusals))
            app.state.gateway = Gateway(
                settings=settings, validator=validator, upstreams=upstreams,
                limiter=RateLimiter(settings.gateway.limits), metrics=metrics,
                adapters=AdapterRoutes(home, upstreams, artifact_store(settings.artifacts, home),
                                       base_configs(settings, home), on_change=cache.invalidate),
                compliance=compliance, cache=cache,
                keys=KeyAuthenticator(home, Users(settings, home).lookup, settings.gateway.introspect_ttl_s),
                identity=identity)
            SlowClients.closed = _slow_client_accounting(writer, refusals, metrics)
            await validator.try_refresh_keys()  # Keycloak may still be starting
            await upstreams.replicas.check()  # which engines answer, before the first request
            # A client of its own: a stopped Keycloak holds no connection the keys are fetched on.
            probe_http = await stack.enter_async_context(keycloak_client(keycloak_trust, connect_s))
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(upstreams.replicas.watch)
                tasks.start_soon(dependencies.watch, probe_http)  # Keycloak and its PostgreSQL answer
                tasks.start_soon(_keys_until_fetched, validator)
                tasks.start_soon(app.state.gateway.keys.warm)  # API keys' owners, once Keycloak answers
                tasks.start_soon(_checkpoint_timer, writer, settings.audit.checkpoint_interval_s)
                tasks.start_soon(_summaries_timer, writer, refusals, settings.audit.refusal_interval_s)
                tasks.start_soon(_summaries_timer, writer, monitoring, settings.audit.monitoring_interval_s)
                if keycloak.events_poll_s > 0:  # failed logins, lockouts, admin changes (serve.keycloak_events)
                    tasks.start_soon(KeycloakEvents(settings, home, writer, http, logins).run)
                    tasks.start_soon(_summaries_timer, writer, logins, settings.audit.refusal_interval_s)
                if settings.audit.archive_interval_s > 0:
                    tasks.start_soon(_archive_timer, settings, home, metrics)
                tasks.start_soon(app.state.gateway.adapters.follow_canaries,
                                 _canary_recorder(writer, metrics))
                # What the start made lives as long as the gateway: frozen out of the collector's
                # full passes, which otherwise walk every module, route and model class (over
                # 100 ms on 2 cores) in the middle of whichever request set them off.
                gc.collect()
                gc.freeze()
                yield
                tasks.cancel_scope.cancel()
            SlowClients.closed = None
            write_due(writer, refusals, all_now=True)
            write_due(writer, monitoring, all_now=True)
            write_due(writer, logins, all_now=True)
            writer.close()

    metrics = Metrics()
    audit = settings.audit
    writer = AuditWriter(home.audit, signing_key(home), checkpoint_every=audit.checkpoint_every,
                         checkpoint_interval_s=audit.checkpoint_interval_s,
                         max_file_bytes=audit.max_file_bytes)
    metrics.registry.register(StateCollector(home, writer, settings.gateway.certificate))
    metrics.registry.register(Reused(QueueCollector(home)))
    metrics.registry.register(Reused(ProgramCollector(home)))
    dependencies = DependencyProbes(home)
    metrics.registry.register(dependencies)
    metrics.registry.register(ClusterCollector(home, _spanning(settings)))
    metrics.registry.register(Reused(GpuCollector(home, settings.monitoring.nvml_library)))
    app = FastAPI(title="appliance gateway", version="1", lifespan=lifespan)
    app.state.audit = writer
    app.state.home = home
    # A multipart upload carries its file and a little framing.
    app.add_middleware(BodyLimitMiddleware, limit=settings.gateway.max_body_bytes,
                       paths={"/v1/files": settings.batch.max_file_bytes + 64 * 1024})
    refusals = Refusals(audit.refusal_interval_s, audit.refusal_sources)
    logins = Summaries(audit.refusal_interval_s, audit.refusal_sources, party_field="source", summary_action=None)
    monitoring = Summaries(audit.monitoring_interval_s, MONITORING_USERS, party_field="subject",
                           summary_action=None)
    app.add_middleware(AuthenticateFirst, needs=ROLES_UNDER)  # inside the audit: refusals are recorded
    app.add_middleware(AuditMiddleware, writer=writer, hasher=TextHasher(home), capture_text=audit.capture_text,
                       refusals=refusals, monitoring=monitoring, count_repeated_reads=audit.count_repeated_reads)
    app.add_middleware(MeterMiddleware, metrics=metrics)  # outermost: counts 413s too

    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(ModelNotFound)
    async def model_not_found(request: Request, exc: ModelNotFound) -> JSONResponse:
        # The router knows the served models; the adapters a caller may use depend on their roles.
        who: Principal | None = getattr(request.state, "principal", None)
        if who is None:
            return exc.response()
        adapters = request.app.state.gateway.adapters.visible(who.roles)
        return exc.for_caller((entry["id"] for entry in adapters), who.may_use).response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        # The OpenAI routes answer 400 as OpenAI does; the admin API keeps FastAPI's 422.
        return validation_error(exc.errors(), 400 if request.url.path.startswith("/v1/") else 422).response()

    @app.exception_handler(RequestTooLarge)
    async def too_large(request: Request, exc: RequestTooLarge) -> JSONResponse:
        return exc.error.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # The framework's own refusals (no such route, wrong method, a body it cannot parse,
        # such as JSON nested past the parser's depth) in OpenAI's shape too.
        return GatewayError(exc.status_code, str(exc.detail), code="http_error", headers=exc.headers).response()

    @app.exception_handler(ApplianceError)
    async def core_error(request: Request, exc: ApplianceError) -> JSONResponse:
        log.warning("request %s: %s", getattr(request.state, "request_id", "-"), exc.one_line())
        return from_core(exc).response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Whatever it was, the client gets OpenAI's error shape (never a plain-text 500) and the
        # log gets the traceback with the request id to find it by.
        request_id = getattr(request.state, "request_id", "-")
        log.error("request %s failed", request_id, exc_info=exc)
        return GatewayError(500, f"internal error (request {request_id}); the administrator can find it in "
                            "the gateway's log", type="server_error", code="internal_error").response()

    @app.get("/healthz", response_model=Health, tags=["health"])
    async def healthz() -> Health:
        """The gateway process is alive."""
        return Health(status="ok")

    ready: dict[str, Any] = {"at": float("-inf"), "body": None}
    ready_lock = anyio.Lock()

    @app.get("/readyz", response_model=Health, tags=["health"],
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

    @app.get("/metrics", tags=["health"], response_class=Response)
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

    @app.get("/metrics/engines", tags=["health"], response_class=Response)
    async def engines_prometheus(request: Request) -> Response:
        """The engines' own metrics (vLLM's), each replica's labelled with its pool, replica and tier;
        for the appliance's Prometheus only (its password), since each scrape reaches every engine."""
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(errors="replace"), monitoring_credential.encode()):
            return Response("the monitoring password is needed\n", status_code=401,
                            headers={"WWW-Authenticate": 'Basic realm="appliance monitoring"'})
        return Response(await request.app.state.gateway.upstreams.engine_metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", tags=["openai"], name="models.list")
    async def list_models(request: Request, who: ChatUser) -> dict[str, Any]:
        """The models the engine pools serve, and the adapters the caller's roles may use."""
        gateway: Gateway = request.app.state.gateway
        with gateway.limiter.admit(who.subject, who.roles):
            return await _models(gateway, who)

    async def _models(gateway: Gateway, who: Principal) -> dict[str, Any]:
        # By served name, never a path (serve.upstream.model_entry); clients call adapters by their
        # names (below), not the engines' versions. A model served in tiers is listed once.
        listed = {entry["id"]: entry for entry in await gateway.upstreams.models()}
        data = list(listed.values())
        if data:
            data += gateway.adapters.visible(who.roles)
        if not data:
            raise GatewayError(503, "no engine pool is reachable; retry shortly",
                               type="service_unavailable", code="engine_unavailable",
                               headers={"Retry-After": "5"})
        return {"object": "list", "data": [entry for entry in data if who.may_use(str(entry.get("id")))]}

    @app.post("/v1/feedback", tags=["openai"], name="feedback.create")
    async def feedback(request: Request, who: ChatUser, body: FeedbackRequest) -> dict[str, Any]:
        """Report on an adapter answer you got, by its id (within the hour): whether it did the task
        and how satisfied you were (1 to 5). A canary under analysis compares versions on them."""
        gateway: Gateway = request.app.state.gateway
        with gateway.limiter.admit(who.subject, who.roles):
            try:  # another's answer is as unknown as one never given
                answered, counted = gateway.adapters.canaries.report(body.id, who.subject, body.success,
                                                                     body.satisfaction)
            except NotFound as exc:
                raise GatewayError(404, exc.message, type="not_found_error", code="answer_not_found",
                                   param="id") from None
            except Conflict as exc:
                raise GatewayError(409, exc.message, code="already_reported", param="id") from None
            note_target(request, "adapter", answered.name, version=answered.version)
            outcome = "none" if body.success is None else "success" if body.success else "failure"
            gateway.metrics.adapter_feedback.labels(answered.name, str(answered.version), outcome).inc()
            return {"object": "feedback", "id": body.id, "adapter": answered.name, "version": answered.version,
                    "counted": counted}

    @app.post("/v1/chat/completions", tags=["openai"], name="chat.completions")
    async def chat_completions(request: Request, who: ChatUser, body: ChatRequest) -> Response:
        """Chat completion, streamed (SSE) or not, relayed to the pool serving `model`."""
        return await relay(request, who, "/v1/chat/completions", body)

    @app.post("/v1/completions", tags=["openai"], name="completions")
    async def text_completions(request: Request, who: ChatUser, body: CompletionRequest) -> Response:
        """Text completion, streamed (SSE) or not, relayed to the pool serving `model`."""
        return await relay(request, who, "/v1/completions", body)

    # After the /v1 routes: routes are matched in order, and /v1 carries the traffic.
    for router in [*admin_routers(settings, home), identity_router(settings)]:
        app.include_router(router)
    return app


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


async def relay(request: Request, who: Principal, path: str, body: ChatRequest | CompletionRequest) -> Response:
    """Route (tier, adapter), admit, screen, answer from the cache or forward; stream back as it
    arrives; account tokens and time to first token."""
    gateway: Gateway = request.app.state.gateway
    batch: str | None = getattr(request.state, "batch", None)  # a batch request the batch-worker sends
    request.state.transcript = Transcript(model=body.model, batch=batch)  # a refusal's record names the model asked
    if not who.may_use(body.model):
        raise GatewayError(403, f"API key {who.key!r} may use only: {', '.join(sorted(who.models or ()))}",
                           type="permission_error", code="model_not_allowed", param="model")
    payload = body.relayed()
    routed = gateway.adapters.resolve(body.model, who.roles)
    if routed is not None:
        pool, payload["model"], adapter = routed
        how = "adapter"
    else:
        (pool, how), adapter = gateway.upstreams.route(body.model, stream=bool(body.stream) and not batch,
                                                       prompt_chars=len(body.prompt_text(payload))), None
        payload["model"] = pool.model  # a tier asked for by name (MODEL:TIER) is the engine's model
    gateway.metrics.tier_requests.labels(pool.model, pool.tier or "-", how).inc()
    policy, marks = gateway.compliance.policy(who.roles), Marks()
    transcript = request.state.transcript = Transcript(model=payload["model"], marks=marks, tier=pool.tier,
                                                       batch=batch)
    prompt_estimate, worst_completion = body.admission(gateway.limiter.limits_for(who.roles), pool.max_model_len,
                                                       payload, body.prompt_text(payload))
    if body.stream:
        # Ask for the final usage chunk so tokens can be counted and charged.
        payload["stream_options"] = {**(payload.get("stream_options") or {}), "include_usage": True}
    admission = gateway.limiter.admit(who.subject, who.roles, prompt_tokens=prompt_estimate,
                                      completion_tokens=worst_completion)
    if who.key is not None and who.tokens_per_minute is not None:
        try:
            # By owner and name: two users' keys of one name have budgets of their own.
            admission.also = gateway.limiter.admit_key(key_ref(who.username, who.key), who.tokens_per_minute,
                                                       prompt_tokens=prompt_estimate,
                                                       completion_tokens=worst_completion)
        except GatewayError:
            admission.settle(0, 0)  # the owner's hold goes back: the key's budget refused it
            raise
    headers = {"X-Appliance-Tier": pool.tier} if pool.tier else {}
    try:
        # Compliance filtering, once admitted (a hostile 1 MiB prompt takes a second or more to
        # scan, in a thread): every string the client sent but the model's name (stop strings and
        # tool schemas reach the engine too). The prompt hashed and relayed is the screened one.
        fields = tuple(name for name in payload if name != "model")
        await anyio.to_thread.run_sync(gateway.compliance.screen_prompt, payload, fields, policy, marks)
        screen = gateway.compliance.answer_filter(policy, marks)
        transcript.prompt = body.prompt_text(payload)  # max_tokens and stream_options, set above, shape no prompt
        transcript.params = body.params_text(payload)  # they are among these: what the engine is asked
        keep = None
        lookup, store = wants(request.headers.get("cache-control"))
        if gateway.cache.settings.enabled and deterministic(payload) and store:
            key = gateway.cache.key(subject=who.subject, roles=who.roles, path=path, pool=pool.name, payload=payload)
            if lookup and (hit := gateway.cache.get(key)) is not None:
                gateway.cache.count("hit")
                admission.settle(0, 0)  # the engine did nothing: no tokens are charged
                return _replay(hit, transcript, {**headers, "X-Appliance-Cache": "hit"})
            gateway.cache.count("miss" if lookup else "bypass")
            headers["X-Appliance-Cache"] = "miss" if lookup else "bypass"
            keep = _keeper(gateway.cache, key, body.model, transcript)
        if batch is not None:
            await gateway.upstreams.quiet(pool, gateway.settings.batch.yield_to_interactive,
                                          gateway.settings.batch.max_yield_s)
        if adapter is not None:  # an answer from the engine (a cache hit says nothing of the version)
            transcript.on_finished = _canary_figures(gateway, adapter, who.subject, transcript, bool(body.stream))
        # An adapter's answers name the alias asked for, not the version that answered (the audit
        # record keeps that): a client that cannot tell canary answers apart cannot report on them
        # selectively. The RL service identity, which no person holds, is told the version it trains.
        named = adapter.name if adapter is not None and Role.RL_POLICY not in who.roles else None
        return await _forward(request, gateway, pool, adapter, path, payload, transcript, admission, screen,
                              headers, keep, named)
    except GatewayError:
        admission.settle(0, 0)  # refused before the engine saw it
        raise
    except BaseException:
        admission.settle(None, 0)  # the engine may have seen the prompt: it is charged
        raise


KeepWhenRecorded = Callable[[list[bytes], bool, str], None]


def _canary_figures(gateway: Gateway, adapter: AdapterRecord, subject: str, transcript: Transcript,
                    stream: bool) -> Callable[[int, float], None]:
    """What gives an adapter answer's figures to the canary analysis once its record is written (a
    stream's latency is left out: its record waits on the client's pace of reading)."""
    def finished(status: int, latency_s: float) -> None:
        gateway.metrics.adapter_requests.labels(adapter.name, str(adapter.version), str(status)).inc()
        gateway.adapters.canaries.served(adapter.name, adapter.version, subject, transcript.answer.id, status=status,
                                         failed=transcript.answer.failed, latency_s=None if stream else latency_s,
                                         ttft_s=transcript.ttft_s)
    return finished


def _keeper(cache: ResponseCache, key: str, model: str, transcript: Transcript) -> KeepWhenRecorded:
    """What has an answer (the chunks the client gets) kept in the cache once its request's record
    is written: a stream's only if it reached its end, with no error and not too large to keep."""
    def keep_when_recorded(chunks: list[bytes], stream: bool, media_type: str) -> None:
        def recorded(seq: int) -> None:
            if transcript.answer.failed or (stream and not transcript.ended) or \
                    (isinstance(chunks, Capture) and chunks.overflowed):
                return
            marks = tuple(sorted((where, done) for where, done in transcript.marks.done.items()
                                 if where.startswith("answer.")))
            cache.put(key, CachedAnswer(tuple(chunks), stream, media_type, seq, model, marks, cache.expires()))
        transcript.on_recorded = recorded
    return keep_when_recorded


def _replay(hit: CachedAnswer, transcript: Transcript, headers: dict[str, str]) -> Response:
    """A cached answer, as its first client got it; its record names the original's."""
    transcript.cache_hit_of = hit.seq
    transcript.marks.done.update(hit.answer_marks)
    if not hit.stream:
        answer = decode_json(hit.chunks[0])
        transcript.answer.add_choices(answer.get("choices") if isinstance(answer, dict) else None)
        return Response(hit.chunks[0], media_type=hit.media_type, headers=headers)
    for line in b"".join(hit.chunks).splitlines():
        event = decode_json(line[len(b"data:"):]) if line.startswith(b"data:") and line != b"data: [DONE]" else None
        if isinstance(event, dict):
            transcript.answer.add_choices(event.get("choices"))
    transcript.end()

    async def replayed() -> AsyncIterator[bytes]:  # on the event loop: no thread hop per chunk
        for chunk in hit.chunks:
            yield chunk

    return StreamingResponse(replayed(), media_type=hit.media_type, headers={**headers, "Cache-Control": "no-cache"})


async def _forward(request: Request, gateway: Gateway, pool: Pool, adapter: AdapterRecord | None, path: str,
                   payload: dict[str, Any], transcript: Transcript, admission: Admission,
                   screen: AnswerFilter | None, headers: dict[str, str],
                   keep: KeepWhenRecorded | None, named: str | None) -> Response:
    request_id = request.state.request_id
    started = time.monotonic()
    transcript.relayed = True
    prefix, interactive = transcript.prompt or "", transcript.batch is None
    try:
        sent = await gateway.upstreams.send(pool, path, json.dumps(payload).encode(), request_id, prefix, interactive)
        if adapter is not None and sent.response.status == 404:  # the engine restarted and forgot it
            sent.response.release()
            sent.done()
            await gateway.adapters.load(pool, adapter)
            sent = await gateway.upstreams.send(pool, path, json.dumps(payload).encode(), request_id, prefix,
                                                interactive)
    except GatewayError as exc:
        gateway.metrics.upstream_errors.labels(pool.name, exc.code or "error").inc()
        raise
    response, transcript.replica = sent.response, sent.replica.name
    account = Accounting(gateway.metrics, pool, admission, transcript, started)

    if not payload.get("stream") or response.status != 200:
        try:
            content = await read_answer(response, pool)
        except GatewayError:
            gateway.metrics.upstream_errors.labels(pool.name, "read").inc()
            raise
        finally:
            sent.done()
        if response.status >= 500:
            gateway.metrics.upstream_errors.labels(pool.name, str(response.status)).inc()
        try:
            answer = decode_json(content)
        except ValueError:
            answer = None
        if named is not None and response.status == 200 and isinstance(answer, dict) and \
                answer.get("model") != named:
            answer["model"] = named
            content = json.dumps(answer, separators=(",", ":")).encode()
        if screen is not None and response.status == 200:
            if not isinstance(answer, dict):  # what cannot be screened does not go out
                account.usage(None, 0)  # the engine worked: the prompt is charged
                gateway.metrics.upstream_errors.labels(pool.name, "unscreened").inc()
                raise GatewayError(502, "the engine's answer could not be screened for sensitive data",
                                   type="server_error", code="unscreened_answer")
            answer = await anyio.to_thread.run_sync(screen.answer, answer)
            content = json.dumps(answer, separators=(",", ":")).encode()
        account.usage(*usage_of(answer))
        transcript.answer.note_id(answer)
        if isinstance(answer, dict):
            transcript.answer.add_choices(answer.get("choices"))
        elif content:
            transcript.answer.add_unparsed(content)
        # An engine error is translated to JSON whatever the engine's own type said (read_answer).
        media_type = response.headers.get("content-type", "application/json") if response.status == 200 \
            else "application/json"
        if keep is not None and response.status == 200 and isinstance(answer, dict):
            keep([content], False, media_type)
        return Response(content, status_code=response.status, media_type=media_type, headers=headers)

    sent_chunks = None
    if keep is not None:
        sent_chunks = Capture(gateway.cache.settings.max_entry_bytes)
        keep(sent_chunks, True, "text/event-stream")
    return SettlingStream(admission, relay_stream(response, account, screen, sent_chunks, named),
                          release=sent.done, media_type="text/event-stream",
                          headers={**headers, "Cache-Control": "no-cache"})


@dataclass
class Accounting:
    """A relayed answer's tokens (metrics, the admission, the request's transcript) and its time to
    first token; the stream relay (serve.sse_relay) tells it as a stream passes."""

    metrics: Metrics
    pool: Pool
    admission: Admission
    transcript: Transcript
    started: float

    @property
    def answer(self) -> Answer:
        return self.transcript.answer

    def first_token(self) -> None:
        self.transcript.ttft_s = time.monotonic() - self.started
        self.metrics.ttft.labels(self.pool.model).observe(self.transcript.ttft_s)

    def usage(self, prompt_tokens: int | None, completion_tokens: int) -> None:
        """Count and charge the tokens; prompt None (a stream cut short): the admission's estimate."""
        prompt = self.admission.prompt_estimate if prompt_tokens is None else prompt_tokens
        self.transcript.prompt_tokens, self.transcript.completion_tokens = prompt, completion_tokens
        self.metrics.tokens.labels("in", self.pool.model).inc(prompt)
        self.metrics.tokens.labels("out", self.pool.model).inc(completion_tokens)
        self.admission.settle(prompt, completion_tokens)

    def end(self) -> None:
        self.transcript.end()


class SettlingStream(StreamingResponse):
    """A relayed stream that settles its admission however it ends, even when the client left
    before the first byte (the stream's generator then never runs)."""

    def __init__(self, admission: Admission, *args: Any, release: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.admission = admission
        self.release = release  # the replica's request in flight ends

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                # Close the relay now (a generator left at its `yield` is not), so that its own ending
                # (usage, compliance marks, the engine let go) comes before the request's record.
                await cast(AsyncGenerator[bytes, None], self.body_iterator).aclose()
            finally:
                self.release()
                self.admission.settle(None, 0)


async def _keys_until_fetched(validator: TokenValidator) -> None:
    """Fetch the realm's signing keys until the first fetch succeeds (later refetches happen on
    an unknown key id, rate-limited, in the validator); /readyz says so meanwhile."""
    while not validator.has_keys:
        await anyio.sleep(KEYS_RETRY_S)
        await validator.try_refresh_keys()


SLOW_CLIENT_ERRORS = {"headers": "request headers not complete in time", "body": "request body not complete in time",
                      "response": "responses left unread", "pipelined": "too many pipelined requests",
                      "evicted": "closed to make room past the connection cap while still sending its request",
                      "over_cap": "refused past the connection cap (no connection to close instead)"}


def _slow_client_accounting(writer: AuditWriter, refusals: Refusals,
                            metrics: Metrics) -> Callable[[str, str | None], None]:
    """What the listener calls for each connection it closes for slowness: counted in /metrics,
    and recorded in the audit log as a refusal of its source (408), so summarised per source and
    interval like any other; the write goes to a thread, off the event loop."""
    def closed(reason: str, source: str | None) -> None:
        metrics.slow_connections.labels(reason).inc()
        event = AuditEvent(request_id="", action="connection.closed_slow", outcome="denied", status=408,
                           source=source, error=SLOW_CLIENT_ERRORS[reason])
        if refusals.own_record(event):
            asyncio.get_running_loop().run_in_executor(None, _append_quietly, writer, event)
    return closed


def _refusal_recorder(writer: AuditWriter, refusals: Refusals) -> Callable[[AuditEvent], Awaitable[None]]:
    """How a route outside the audited prefixes (the published login endpoints) records a refusal:
    summarised per source like any other, durable before its answer (AuditUnavailable raised)."""
    async def record(event: AuditEvent) -> None:
        if refusals.own_record(event):
            await anyio.to_thread.run_sync(writer.append, event)
    return record


def _append_quietly(writer: AuditWriter, event: AuditEvent) -> None:
    try:
        writer.append(event)
    except AuditUnavailable:
        pass  # the writer now reports the failure; requests and /readyz fail closed
    except Exception:  # nothing awaits this write: say so here
        log.exception("record of a slow connection not written")


async def _summaries_timer(writer: AuditWriter, summaries: Summaries, interval_s: float) -> None:
    """Write the summary records (of refused requests, of monitoring reads) when their interval ends."""
    while True:
        await anyio.sleep(interval_s)
        await anyio.to_thread.run_sync(write_due, writer, summaries)


def _canary_recorder(writer: AuditWriter, metrics: Metrics) -> Callable[[Ended, str | None], Awaitable[None]]:
    """What records a canary analysis's decision: an audit record of the gateway naming the
    adapter and the canary version, with the figures of both versions (or why it failed)."""
    async def record(ended: Ended, error: str | None) -> None:
        metrics.canary_decisions.labels(ended.decision if error is None else "failed").inc()
        event = AuditEvent(request_id=uuid.uuid4().hex, action=f"adapters.canary_{ended.decision}",
                           outcome="allowed" if error is None else "error", status=200 if error is None else 500,
                           subject="canary-analysis", username="canary-analysis", client="gateway", source="local",
                           resource="gateway", target=Target(kind="adapter", name=ended.name,
                                                             version=ended.window.canary),
                           detail=ended.detail(), error=error)
        try:
            await anyio.to_thread.run_sync(writer.append, event)
        except AuditUnavailable:
            log.error("canary decision not recorded (the audit log is unwritable): %s", ended.detail())
    return record


async def _checkpoint_timer(writer: AuditWriter, interval_s: float) -> None:
    """Sign the chain head every interval even when traffic is idle, so a cut tail shows."""
    while True:
        await anyio.sleep(interval_s)
        try:
            await anyio.to_thread.run_sync(writer.checkpoint)
        except AuditUnavailable:
            pass  # the writer now reports the failure; requests and /readyz fail closed


async def _archive_timer(settings: Settings, home: Home, metrics: Metrics) -> None:
    """Copy closed log files to the artifact store now and then; a failure is logged and
    counted (the local log stays authoritative and durable) and retried next time."""
    store = artifact_store(settings.artifacts, home)
    audit = settings.audit

    def copy() -> None:
        archive(home.audit, store, retain_days=audit.archive_retention_days,
                require_lock=audit.archive_require_lock)

    while True:
        await anyio.sleep(audit.archive_interval_s)
        try:
            await anyio.to_thread.run_sync(copy)
            metrics.archived_at.set_to_current_time()
        except (ApplianceError, OSError, ValueError) as exc:  # never let a copy take the gateway down
            metrics.archive_failures.inc()
            log.warning("audit archive failed: %s", exc.one_line() if isinstance(exc, ApplianceError) else exc)


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
