"""Keycloak's public endpoints, published through the gateway's HTTPS listener.

With `gateway.public_url` set, users on other machines log in through the gateway: one port, one
certificate and one firewall rule for everything, under the gateway's connection caps and
slow-client guards. Only what a login needs is forwarded, for the appliance's realm only: the
token, device-authorisation, key and discovery endpoints, the device verification page and the
login pages it leads to (`login-actions`), and the pages' static resources. Keycloak's admin
console and REST API, the master realm and token introspection stay on loopback: anything else
under /realms/ or /resources/ is a 404 here.

Keycloak's own brute-force detection and event store see each login with its source (the gateway
sends X-Forwarded-For, which Keycloak believes from loopback only); the gateway copies failed
logins and lockouts into the audit log (serve.keycloak_events). `/.well-known/appliance` tells a
CLI on a workstation the realm's issuer and client.
"""

from __future__ import annotations

import re
import urllib.parse
from typing import Any

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import Response

from appliance.settings import Settings
from serve.errors import GatewayError

# Under /realms/<realm>/: (method, path pattern) pairs that are forwarded.
FORWARDED = [
    ("POST", r"protocol/openid-connect/token"),
    ("POST", r"protocol/openid-connect/auth/device"),
    ("POST", r"protocol/openid-connect/revoke"),
    ("GET", r"protocol/openid-connect/certs"),
    ("GET", r"protocol/openid-connect/auth"),
    ("GET", r"\.well-known/openid-configuration"),
    ("GET", r"device"),
    ("POST", r"device"),
    ("GET", r"login-actions/[a-z-]+"),
    ("POST", r"login-actions/[a-z-]+"),
]
# /resources/<version>/<theme>/...: each segment starts with a letter, digit, "_" or "-" (no "." or
# ".." segment, which a client library or Keycloak would resolve to another path).
RESOURCE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*(/[A-Za-z0-9_-][A-Za-z0-9._-]*)*")
# Request headers a login needs; everything else (Authorization included) stays behind.
REQUEST_HEADERS = ("content-type", "accept", "accept-language", "cookie", "user-agent", "origin")
# Response headers not passed back: the connection's own, and the body's framing (re-made here).
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "upgrade",
              "proxy-authenticate", "trailer", "te"}


class IdentityProxy:
    """Forwards the allowed requests to the embedded Keycloak on loopback."""

    def __init__(self, settings: Settings, http: httpx.AsyncClient) -> None:
        keycloak = settings.keycloak
        self.realm = keycloak.realm
        self.base_url = keycloak.base_url
        public = urllib.parse.urlsplit(settings.gateway.public_url or "")
        self.forwarded_host = public.netloc
        self.http = http
        self.allowed = [(method, re.compile(pattern)) for method, pattern in FORWARDED]

    def permits(self, method: str, path: str) -> bool:
        """Whether `method path` (the request's path, decoded) is forwarded."""
        realm_prefix = f"/realms/{self.realm}/"
        if path.startswith(realm_prefix):
            rest = path[len(realm_prefix):]
            return any(method == allowed and pattern.fullmatch(rest) for allowed, pattern in self.allowed)
        if path.startswith("/resources/"):
            return method == "GET" and RESOURCE.fullmatch(path[len("/resources/"):]) is not None
        return False

    async def forward(self, request: Request) -> Response:
        path = request.url.path
        target = httpx.URL(f"{self.base_url}{path}")
        # What is checked is what is sent: no escapes, and a path the client library leaves as it is.
        if (not self.permits(request.method, path) or "%" in request.scope.get("raw_path", b"").decode("latin-1")
                or target.path != path):
            raise GatewayError(404, f"{request.method} {path[:200]} is not published", code="not_found")
        headers = {name: value for name, value in request.headers.items() if name in REQUEST_HEADERS}
        peer = request.client.host if request.client else ""
        headers.update({"x-forwarded-for": peer, "x-forwarded-proto": "https", "x-forwarded-host": self.forwarded_host,
                        "accept-encoding": "identity"})
        query = request.url.query
        try:
            answer = await self.http.request(request.method, f"{self.base_url}{path}{'?' + query if query else ''}",
                                             headers=headers, content=await request.body(), timeout=30.0)
        except httpx.HTTPError as exc:
            raise GatewayError(503, f"Keycloak does not answer ({type(exc).__name__}); retry shortly",
                               type="service_unavailable", code="keycloak_unavailable",
                               headers={"Retry-After": "5"}) from exc
        response = Response(answer.content, status_code=answer.status_code)
        for name, value in answer.headers.multi_items():
            if name.lower() not in HOP_BY_HOP:
                response.headers.append(name, value)
        return response


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
