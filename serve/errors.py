"""Errors the gateway answers with, in OpenAI's error shape.

GatewayError          root: status, OpenAI error type and code, extra headers
 +-- AuthError        401 with WWW-Authenticate (bad or missing token) or 403 (missing role)

`from_core` is the one table from the core's errors (appliance.errors) to HTTP.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse

from appliance.errors import ApplianceError, Conflict, Invalid, NotFound, QuotaExceeded, Unavailable


class SafeJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: a lone surrogate from a hostile request
    (echoed in an error's message) cannot make the body unencodable."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


class GatewayError(Exception):
    """An error with an HTTP status that the client caused or should retry."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    def response(self) -> JSONResponse:
        """{"error": {"message", "type", "param", "code"}} with this error's status and headers."""
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return SafeJSONResponse(body, status_code=self.status, headers=self.headers)


class AuthError(GatewayError):
    """A token was missing, invalid (401) or lacked a role (403); `reason` labels the metric."""

    def __init__(self, reason: str, message: str, *, status: int = 401) -> None:
        headers = {}
        if status == 401:
            # RFC 6750 section 3: no error code when the request carried no token at all.
            error = "" if reason == "missing_token" else ' error="invalid_token",'
            headers["WWW-Authenticate"] = f'Bearer realm="appliance",{error} error_description="{message}"'
        kind = {401: "authentication_error", 403: "permission_error"}.get(status, "service_unavailable")
        if status == 503:
            headers["Retry-After"] = "5"
        super().__init__(status, message, type=kind, code=reason, headers=headers)
        self.reason = reason


# The core's error families and what the gateway answers for them (status, OpenAI error type).
CORE_ERRORS: tuple[tuple[type[ApplianceError], int, str], ...] = (
    (Invalid, 400, "invalid_request_error"),
    (NotFound, 404, "invalid_request_error"),
    (Conflict, 409, "invalid_request_error"),
    (QuotaExceeded, 429, "rate_limit_error"),
    (Unavailable, 503, "service_unavailable"),
)


def from_core(exc: ApplianceError) -> GatewayError:
    """The gateway's answer to an error from the core: its family's status, its own code; an
    error of no family is the server's fault (500)."""
    for family, status, kind in CORE_ERRORS:
        if isinstance(exc, family):
            headers = {"Retry-After": "5" if status == 503 else "60"} if status in (429, 503) else None
            return GatewayError(status, exc.message, type=kind, code=exc.code, headers=headers)
    return GatewayError(500, exc.message, type="server_error", code=exc.code)
