"""Pure ASGI middleware (safe around streaming responses): request ids and metering, callers
authenticated before their bodies are read, and the request body size limit."""

from __future__ import annotations

import time

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from appliance.errors import ApplianceError
from serve.context import open_context
from serve.deps import authenticated, best_role
from serve.errors import AuthError, GatewayError, from_core
from serve.metrics import Metrics


class MeterMiddleware:
    """Pure ASGI: every request's context (serve.context), opened here, outermost, with its request
    id; count and time every response by route, status and the caller's role (streaming responses
    are timed to their last byte)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        context = open_context(scope)
        request_id = context.request_id
        started = time.monotonic()
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            role = best_role(context.principal.roles) if context.principal is not None else "none"
            self.metrics.requests.labels(route, str(status), role).inc()
            self.metrics.latency.labels(route).observe(time.monotonic() - started)


class AuthenticateFirst:
    """Pure ASGI: every route under the `needs` prefixes needs a token, so the caller is
    authenticated from the request's headers before anything reads its body, and refused (403) if
    they hold none of the roles any route under the prefix admits; a refusal closes the
    connection, so a client without the right token cannot make the gateway read or spool a body
    at all. The principal is left in the request's context for the routes' own (exact) checks."""

    def __init__(self, app: ASGIApp, needs: dict[str, frozenset[str]]) -> None:
        self.app = app
        self.needs = needs  # path prefix -> the roles some route under it admits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        roles = next((roles for prefix, roles in self.needs.items() if scope.get("path", "").startswith(prefix)),
                     None) if scope["type"] == "http" else None
        if roles is not None:
            request = Request(scope)
            try:
                who = await authenticated(request, None)
                if not who.roles & roles:
                    request.app.state.gateway.metrics.auth_failures.labels("missing_role").inc()
                    raise AuthError("missing_role", f"none of your roles may use {scope['path'].split('/')[1]}/",
                                    status=403)
            except (GatewayError, ApplianceError) as exc:  # a core error (the batch queue busy): its status
                refusal = (exc if isinstance(exc, GatewayError) else from_core(exc)).response()
                refusal.headers["Connection"] = "close"  # the body is never read
                await refusal({"type": "http"}, _empty_receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Pure ASGI: refuse bodies over `limit` bytes with 413, by header or while reading."""

    def __init__(self, app: ASGIApp, limit: int, paths: dict[str, int] | None = None) -> None:
        self.app = app
        self.limit = limit
        self.paths = paths or {}  # paths with limits of their own (file uploads)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.paths.get(scope["path"], self.limit)
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(send, limit)
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise RequestTooLarge(limit)
            return message

        try:
            await self.app(scope, limited_receive, send)
        except RequestTooLarge:  # raised where nothing in the app turned it into a response
            await self._refuse(send, limit)

    async def _refuse(self, send: Send, limit: int) -> None:
        await RequestTooLarge(limit).error.response()({"type": "http"}, _empty_receive, send)


class RequestTooLarge(HTTPException):
    """A body that outgrew the limit while it was read (chunked, no Content-Length). An
    HTTPException because FastAPI's body parsing re-raises those (anything else becomes a 400);
    the app answers it with `error`, a 413 in OpenAI's shape."""

    def __init__(self, limit: int) -> None:
        super().__init__(status_code=413)
        self.error = GatewayError(413, f"request body is larger than {limit} bytes", code="request_too_large")


async def _empty_receive() -> Message:
    return {"type": "http.disconnect"}
