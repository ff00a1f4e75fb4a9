"""The gateway's exception handlers: every error answered in OpenAI's shape (serve.errors), the
framework's own refusals too; anything unexpected a 500 logged with its request id."""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from appliance.errors import ApplianceError
from serve.context import context_of
from serve.errors import GatewayError, ModelNotFound, from_core, validation_error
from serve.middleware import RequestTooLarge

log = logging.getLogger("appliance.gateway")


async def gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
    return exc.response()


async def model_not_found(request: Request, exc: ModelNotFound) -> JSONResponse:
    # The router knows the served models; the adapters a caller may use depend on their roles.
    who = context_of(request).principal
    if who is None:
        return exc.response()
    adapters = request.app.state.gateway.adapters.visible(who.roles)
    return exc.for_caller((entry["id"] for entry in adapters), who.may_use).response()


async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
    # The OpenAI routes answer 400 as OpenAI does; the admin API keeps FastAPI's 422.
    return validation_error(exc.errors(), 400 if request.url.path.startswith("/v1/") else 422).response()


async def too_large(request: Request, exc: RequestTooLarge) -> JSONResponse:
    return exc.error.response()


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # The framework's own refusals (no such route, wrong method, a body it cannot parse,
    # such as JSON nested past the parser's depth) in OpenAI's shape too.
    return GatewayError(exc.status_code, str(exc.detail), code="http_error", headers=exc.headers).response()


async def core_error(request: Request, exc: ApplianceError) -> JSONResponse:
    log.warning("request %s: %s", context_of(request).request_id, exc.one_line())
    return from_core(exc).response()


async def unexpected(request: Request, exc: Exception) -> JSONResponse:
    # Whatever it was, the client gets OpenAI's error shape (never a plain-text 500) and the
    # log gets the traceback with the request id to find it by.
    request_id = context_of(request).request_id
    log.error("request %s failed", request_id, exc_info=exc)
    return GatewayError(500, f"internal error (request {request_id}); the administrator can find it in "
                        "the gateway's log", type="server_error", code="internal_error").response()


# For FastAPI(exception_handlers=...): the most specific class a raised exception is an instance of
# picks its handler, as with app.exception_handler.
ERROR_HANDLERS: dict[int | type[Exception], Callable[[Request, Any], Coroutine[Any, Any, Response]]] = {
    GatewayError: gateway_error, ModelNotFound: model_not_found, RequestValidationError: invalid_body,
    RequestTooLarge: too_large, StarletteHTTPException: http_error, ApplianceError: core_error,
    Exception: unexpected,
}
