"""Request dependencies shared by the gateway's routes: who is calling, and may they."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from appliance.roles import ROLE_ORDER
from serve.auth import Principal
from serve.errors import AuthError

bearer = HTTPBearer(auto_error=False, description="A Keycloak access token of realm `appliance`.")


def best_role(roles: frozenset[str]) -> str:
    """The role that labels this caller's metrics."""
    return next((role for role in ROLE_ORDER if role in roles), "none")


async def authenticated(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> Principal:
    """The caller, from a valid bearer token (401 otherwise).

    `credentials` is declared only so the OpenAPI document shows the bearer scheme; the raw
    header is validated, so a malformed one gets a precise reason.
    """
    gateway = request.app.state.gateway
    try:
        who: Principal = await gateway.validator.validate(request.headers.get("authorization"))
    except AuthError as exc:
        gateway.metrics.auth_failures.labels(exc.reason).inc()
        raise
    request.state.role = best_role(who.roles)
    request.state.principal = who
    return who


def requires(*roles: str) -> Callable[..., Awaitable[Principal]]:
    """A dependency admitting callers holding any of `roles` (403 otherwise)."""
    wanted = frozenset(roles)

    async def check(request: Request, who: Annotated[Principal, Depends(authenticated)]) -> Principal:
        if not who.roles & wanted:
            request.app.state.gateway.metrics.auth_failures.labels("missing_role").inc()
            names = " or ".join(f"'{r}'" for r in roles)
            raise AuthError("missing_role", f"the {names} role is required", status=403)
        return who

    return check


ChatUser = Annotated[Principal, Depends(requires("user", "admin"))]
