"""Keycloak's public endpoints, published through the gateway's HTTPS listener.

With `gateway.public_url` set, users on other machines log in through the gateway: one port, one
certificate and one firewall rule for everything, under the gateway's connection caps and
slow-client guards. Only what a login needs is forwarded, for the appliance's realm only: the
token, device-authorisation, revocation, key and discovery endpoints, the device verification page
and its status page, the login pages it leads to (`login-actions`), and the pages' static
resources. Keycloak's admin console and REST API, the master realm and token introspection stay on
loopback: anything else under /realms/ or /resources/ is a 404 here.

Every request stands alone. The proxy's HTTP client keeps no cookies (serve.keycloak_http): the
cookies Keycloak sees are those the request carried, and those it sets go back in that request's
response only; no login state lives in the gateway between requests. Only the appliance's own
public client (`keycloak.cli_client_id`) may be named as `client_id` (in the form and in the
query, where Keycloak looks when its form names none), so Keycloak's other clients (its admin and
account consoles) show no login page here; what is checked is what Keycloak reads: a form is UTF-8,
and a header forwarded is given once. Each route reads at most the bytes its
Keycloak form needs (Content-Length checked first, then while reading; 413 past it), and only
after the route, the client and the source's throttle let the request through: each source address
has a bucket of login attempts (`gateway.login_burst`, `gateway.login_attempts_per_minute`), and an
attempt past it is a 429 with Retry-After, recorded in the audit log as a refusal of its source.

Keycloak's own brute-force detection and event store see each login with its source (the gateway
sends X-Forwarded-For, which Keycloak believes from loopback only); the gateway copies failed
logins and lockouts into the audit log (serve.keycloak_events). `/.well-known/appliance` tells a
CLI on a workstation the realm's issuer and client.
"""

from __future__ import annotations

import math
import re
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import Response

from appliance.settings import Settings
from audit import AuditEvent, AuditUnavailable
from serve.context import context_of
from serve.errors import GatewayError
from serve.limits import SourceThrottle
from serve.summaries import cap_text

FORM = "application/x-www-form-urlencoded"


@dataclass(frozen=True)
class Route:
    """A forwarded route under /realms/<realm>/: its method and path, the most body bytes its
    Keycloak form needs, where its `client_id` is named (None: nowhere), and whether each request
    is a login attempt counted against its source."""

    method: str
    path: re.Pattern[str]
    max_body: int
    client_in: str | None
    attempt: bool


def _route(method: str, path: str, max_body: int, client_in: str | None, attempt: bool = True) -> Route:
    return Route(method, re.compile(path), max_body, client_in, attempt)


# A refresh token, a device code and the client id fit in 16 KiB many times over; a login page's
# form is a user name and a password (at most 128 characters by the realm's policy).
ROUTES = [
    _route("POST", r"protocol/openid-connect/token", 16384, "form"),
    _route("POST", r"protocol/openid-connect/auth/device", 4096, "form"),
    _route("POST", r"protocol/openid-connect/revoke", 16384, "form"),
    _route("GET", r"protocol/openid-connect/auth", 0, "query"),
    _route("GET", r"protocol/openid-connect/certs", 0, None, attempt=False),
    _route("GET", r"\.well-known/openid-configuration", 0, None, attempt=False),
    _route("GET", r"device", 0, None),  # its user_code is a secret to guess
    _route("POST", r"device", 4096, None),
    _route("GET", r"device/status", 0, None),  # where a device login ends
    _route("GET", r"login-actions/[a-z-]+", 0, "query"),
    _route("POST", r"login-actions/[a-z-]+", 8192, "query"),
]
# /resources/<version>/<theme>/...: each segment starts with a letter, digit, "_" or "-" (no "." or
# ".." segment, which a client library or Keycloak would resolve to another path).
RESOURCE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*(/[A-Za-z0-9_-][A-Za-z0-9._-]*)*")
RESOURCE_ROUTE = Route("GET", RESOURCE, 0, None, attempt=False)
# Request headers a login needs; everything else (Authorization included) stays behind. The
# cookie is the request's own: the proxy's client keeps none (serve.keycloak_http).
REQUEST_HEADERS = ("content-type", "accept", "accept-language", "cookie", "user-agent", "origin")
# Response headers not passed back: the connection's own, and the body's framing (re-made here).
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "upgrade",
              "proxy-authenticate", "trailer", "te"}
THROTTLED = "too many login attempts from this address"

# Records a refusal in the audit log (the gateway's, summarised per source); raises AuditUnavailable.
RecordRefusal = Callable[[AuditEvent], Awaitable[None]]


class IdentityProxy:
    """Forwards the allowed requests to the embedded Keycloak on loopback, each on its own.

    `http` is the proxy's own client, made by serve.keycloak_http.keycloak_client: its jar keeps no
    cookie, and its pool serves logins only (a flood of them never holds the connections the
    gateway checks tokens with). What a pooled connection carries is TCP and TLS state only:
    Keycloak keys a login by its cookies and parameters, never by its connection."""

    def __init__(self, settings: Settings, http: httpx.AsyncClient, record_refusal: RecordRefusal) -> None:
        keycloak = settings.keycloak
        self.realm = keycloak.realm
        self.base_url = keycloak.base_url
        public = urllib.parse.urlsplit(settings.gateway.public_url or "")
        self.forwarded_host = public.netloc
        self.http = http
        self.clients = frozenset({keycloak.cli_client_id})
        self.throttle = SourceThrottle(settings.gateway.login_attempts_per_minute, settings.gateway.login_burst)
        self.record_refusal = record_refusal

    def route(self, method: str, path: str) -> Route | None:
        """The route that forwards `method path` (the request's path, decoded), or None."""
        realm_prefix = f"/realms/{self.realm}/"
        if path.startswith(realm_prefix):
            rest = path[len(realm_prefix):]
            return next((r for r in ROUTES if r.method == method and r.path.fullmatch(rest)), None)
        if path.startswith("/resources/") and method == "GET" and RESOURCE.fullmatch(path[len("/resources/"):]):
            return RESOURCE_ROUTE
        return None

    def permits(self, method: str, path: str) -> bool:
        """Whether `method path` (the request's path, decoded) is forwarded."""
        return self.route(method, path) is not None

    async def forward(self, request: Request) -> Response:
        path = request.url.path
        route = self.route(request.method, path)
        # What is checked is what is sent: no escapes, and a path the client library leaves as it is.
        if (route is None or "%" in request.scope.get("raw_path", b"").decode("latin-1")
                or httpx.URL(f"{self.base_url}{path}").path != path):
            raise GatewayError(404, f"{request.method} {path[:200]} is not published", code="not_found")
        peer = request.client.host if request.client else ""
        if route.attempt:
            await self._take_attempt(peer, request)
        query = request.url.query
        if route.client_in is not None:
            # Keycloak reads a form's client_id, else the query's (as where a body it reads as no form
            # names none): a client_id in the query is checked on every route that takes one.
            self._check_client(urllib.parse.parse_qs(query, keep_blank_values=True), "the query",
                               required=route.client_in == "query")
        headers = _request_headers(request)
        body = await _bounded_body(request, route.max_body)
        if route.client_in == "form":
            self._check_client(_form(headers.get("content-type", ""), body), "the form")
        headers.update({"x-forwarded-for": peer, "x-forwarded-proto": "https", "x-forwarded-host": self.forwarded_host,
                        "accept-encoding": "identity"})
        try:
            answer = await self.http.request(request.method, f"{self.base_url}{path}{'?' + query if query else ''}",
                                             headers=headers, content=body, timeout=30.0)
        except httpx.HTTPError as exc:
            raise GatewayError(503, f"Keycloak does not answer ({type(exc).__name__}); retry shortly",
                               type="service_unavailable", code="keycloak_unavailable",
                               headers={"Retry-After": "5"}) from exc
        response = Response(answer.content, status_code=answer.status_code)
        for name, value in answer.headers.multi_items():
            if name.lower() not in HOP_BY_HOP:
                response.headers.append(name, value)
        return response

    async def _take_attempt(self, peer: str, request: Request) -> None:
        """One login attempt from `peer`, or a 429 recorded as its source's refusal (503 if the
        audit log cannot take it: fail closed)."""
        wait = self.throttle.take(peer)
        if wait == 0:
            return
        refused = GatewayError(429, f"{THROTTLED}; retry in {math.ceil(wait)}s", type="rate_limit_error",
                               code="login_rate_exceeded",
                               headers={"Retry-After": str(math.ceil(wait)), "Connection": "close"})
        event = AuditEvent(request_id=context_of(request).request_id, action="identity.throttled",
                           outcome="denied", status=429, source=peer or None, resource=cap_text(request.url.path),
                           reason="login_rate_exceeded", error=THROTTLED)
        try:
            await self.record_refusal(event)
        except AuditUnavailable as exc:
            raise GatewayError(503, "audit log unavailable, refusing requests", type="service_unavailable",
                               code="audit_unavailable", headers={"Retry-After": "30"}) from exc
        raise refused

    def _check_client(self, fields: dict[str, list[str]], where: str, *, required: bool = True) -> None:
        """The one `client_id` named in `fields` must be the appliance's own client (and if not
        `required`, none may be named either)."""
        named = fields.get("client_id", [])
        if not named and not required:
            return
        if len(named) != 1 or named[0] not in self.clients:
            shown = "no client_id" if not named else f"client_id {cap_text(', '.join(named), 64)!r}"
            raise GatewayError(400, f"{shown} in {where}: only the appliance's own client "
                               f"({', '.join(sorted(self.clients))}) logs in here", code="unknown_client",
                               param="client_id")


async def _bounded_body(request: Request, limit: int) -> bytes:
    """The request's body, refused (413) past `limit` bytes: by its Content-Length before any byte
    is read, else as soon as what arrived passes it."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> GatewayError:
    # The rest of the body is never read: the connection closes after the answer.
    return GatewayError(413, f"request body is larger than {limit} bytes, the most this login endpoint takes",
                        code="request_too_large", headers={"Connection": "close"})


def _request_headers(request: Request) -> dict[str, str]:
    """The request's headers Keycloak is sent (REQUEST_HEADERS), each as the proxy reads it: a
    header given twice is refused, as the proxy would check one value and Keycloak read another
    (a form's Content-Type checked, a multipart one forwarded); cookies given in several headers
    are one list."""
    headers: dict[str, str] = {}
    for name in REQUEST_HEADERS:
        values = request.headers.getlist(name)
        if len(values) > 1 and name != "cookie":
            raise GatewayError(400, f"the {name} header is given {len(values)} times; a login request gives it "
                               "once", code="duplicate_header", param=name)
        if values:
            headers[name] = "; ".join(values)
    return headers


def _form(content_type: str, body: bytes) -> dict[str, list[str]]:
    """A form body's fields, as Keycloak reads them; anything but a URL-encoded UTF-8 form (no
    parameter but charset=utf-8: Keycloak reads another charset's bytes as other fields) is a 415."""
    kind, _, parameters = content_type.partition(";")
    kind = kind.strip().lower()
    charset = parameters.strip().lower().replace('"', "")
    if kind != FORM or charset not in ("", "charset=utf-8"):
        shown = cap_text(content_type, 64) or "no content type"
        raise GatewayError(415, f"this login endpoint takes {FORM} (UTF-8), not {shown}",
                           code="unsupported_media_type")
    try:
        return urllib.parse.parse_qs(body.decode(), keep_blank_values=True, strict_parsing=False)
    except UnicodeDecodeError as exc:
        raise GatewayError(400, "the form is not UTF-8", code="invalid_form") from exc

def router(settings: Settings) -> APIRouter:
    """/.well-known/appliance always; the published Keycloak routes when the gateway has a public URL."""
    routes = APIRouter(tags=["identity"])
    keycloak = settings.keycloak

    @routes.get("/.well-known/appliance", name="identity.discovery")
    async def discovery() -> dict[str, Any]:
        """Where a CLI logs in: the realm's issuer, its path under this gateway and the CLI's client."""
        return {"issuer": keycloak.issuer, "realm_path": f"/realms/{keycloak.realm}",
                "client_id": keycloak.cli_client_id, "published": keycloak.frontend_url is not None}

    if keycloak.frontend_url is None:
        return routes

    async def forward(request: Request) -> Response:
        proxy: IdentityProxy = request.app.state.gateway.identity
        return await proxy.forward(request)

    for prefix in ("/realms/{rest:path}", "/resources/{rest:path}"):
        routes.add_api_route(prefix, forward, methods=["GET", "POST"], include_in_schema=False,
                             name="identity.forward")
    return routes
