"""The gateway's lifespan: the clients (engines, Keycloak), the `Gateway` every handler uses, and
the background tasks (replica and dependency watches, serve.timers, Keycloak's events, canary
analyses), for as long as the app runs; the audit summaries written and the log closed after."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass

import aiohttp
import anyio
from fastapi import FastAPI

from appliance.artifacts import artifact_store
from appliance.home import Home
from appliance.secrets import gateway_client_secret, secret
from appliance.settings import Settings
from appliance.tls import keycloak_ssl
from appliance.users import Users
from audit import AuditWriter
from serve.adapters import AdapterRoutes, base_configs
from serve.api_keys import KeyAuthenticator
from serve.auth import Introspector, TokenValidator
from serve.compliance import Compliance
from serve.dependencies import DependencyProbes
from serve.engine import ENGINE_KEY_SECRET
from serve.gateway_records import AuditSummaries, canary_recorder, refusal_recorder, slow_client_accounting
from serve.identity_proxy import IdentityProxy
from serve.keycloak_events import KeycloakEvents
from serve.keycloak_http import keycloak_client
from serve.limits import RateLimiter
from serve.metrics import Metrics
from serve.replicas import engine_session, pools_from_settings
from serve.response_cache import ResponseCache
from serve.settings_reload import take_settings_on_hangup
from serve.slow_clients import SlowClients
from serve.timers import archive_timer, checkpoint_timer, keys_until_fetched, summaries_timer
from serve.upstream import Upstreams


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


def lifespan(settings: Settings, home: Home, metrics: Metrics, writer: AuditWriter, dependencies: DependencyProbes,
             summaries: AuditSummaries) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The gateway app's lifespan; HTTP clients live as long as the app."""
    audit = settings.audit

    @asynccontextmanager
    async def running(app: FastAPI) -> AsyncIterator[None]:
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
                    keycloak_trust, connect_s)), refusal_recorder(writer, summaries.refusals))
            gateway = app.state.gateway = Gateway(
                settings=settings, validator=validator, upstreams=upstreams,
                limiter=RateLimiter(settings.gateway.limits), metrics=metrics,
                adapters=AdapterRoutes(home, upstreams, artifact_store(settings.artifacts, home),
                                       base_configs(settings, home), on_change=cache.invalidate),
                compliance=compliance, cache=cache,
                keys=KeyAuthenticator(home, Users(settings, home).lookup, settings.gateway.introspect_ttl_s),
                identity=identity)
            SlowClients.closed = slow_client_accounting(writer, summaries.refusals, metrics)
            await validator.try_refresh_keys()  # Keycloak may still be starting
            await upstreams.replicas.check()  # which engines answer, before the first request
            # A client of its own: a stopped Keycloak holds no connection the keys are fetched on.
            probe_http = await stack.enter_async_context(keycloak_client(keycloak_trust, connect_s))
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(upstreams.replicas.watch)
                tasks.start_soon(dependencies.watch, probe_http)  # Keycloak and its PostgreSQL answer
                tasks.start_soon(keys_until_fetched, validator)
                tasks.start_soon(gateway.keys.warm)  # API keys' owners, once Keycloak answers
                tasks.start_soon(checkpoint_timer, writer, audit.checkpoint_interval_s)
                tasks.start_soon(summaries_timer, writer, summaries.refusals, audit.refusal_interval_s)
                tasks.start_soon(summaries_timer, writer, summaries.monitoring, audit.monitoring_interval_s)
                if keycloak.events_poll_s > 0:  # failed logins, lockouts, admin changes (serve.keycloak_events)
                    tasks.start_soon(KeycloakEvents(settings, home, writer, http, summaries.logins).run)
                    tasks.start_soon(summaries_timer, writer, summaries.logins, audit.refusal_interval_s)
                if audit.archive_interval_s > 0:
                    tasks.start_soon(archive_timer, settings, home, metrics)
                tasks.start_soon(gateway.adapters.follow_canaries, canary_recorder(writer, metrics))
                tasks.start_soon(take_settings_on_hangup, gateway.limiter, home)  # `settings apply`
                # What the start made lives as long as the gateway: frozen out of the collector's
                # full passes, which otherwise walk every module, route and model class (over
                # 100 ms on 2 cores) in the middle of whichever request set them off.
                gc.collect()
                gc.freeze()
                yield
                tasks.cancel_scope.cancel()
            SlowClients.closed = None
            summaries.write_all(writer)
            writer.close()

    return running
