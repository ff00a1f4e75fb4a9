"""Request dependencies shared by the gateway's routes: who is calling, and may they."""

from __future__ import annotations

import functools
import hmac
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Annotated

import anyio
from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from appliance import batches
from appliance.api_keys import looks_like_key
from appliance.batches import BATCH_HEADER, BATCH_WORKER_SECRET
from appliance.home import Home
from appliance.roles import ROLE_ORDER
from appliance.secrets import secret
from serve.auth import Principal
from serve.context import context_of
from serve.errors import AuthError

bearer = HTTPBearer(auto_error=False, description="An API key (`apk-...`, from `appliance keys create`) or a "
                    "Keycloak access token of realm `appliance`.")


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
    context = context_of(request)
    if context.principal is not None:
        return context.principal  # authenticated before its body was read (AuthenticateFirst)
    gateway = request.app.state.gateway
    authorization = request.headers.get("authorization")
    try:
        if (batch_request := request.headers.get(BATCH_HEADER)) is not None:
            who = await anyio.to_thread.run_sync(batch_principal, request, batch_request)
            # The roles its owner holds now, of those they held when they made it: a role lost stops
            # the batch (the route's check refuses it, and the worker fails the rest of the batch).
            who = replace(who, roles=who.roles & await gateway.keys.roles_now(who.username, who.subject))
        elif (key := _api_key(authorization)) is not None:
            if request.url.path.startswith("/admin/"):
                raise AuthError("key_not_allowed", "API keys cannot use the admin API; log in with "
                                "`appliance token` (or use a Keycloak token)", status=403)
            who = await gateway.keys.principal(key, known=lambda found: setattr(context, "refused_key", found))
        else:
            who = await gateway.validator.validate(authorization)
    except AuthError as exc:
        gateway.metrics.auth_failures.labels(exc.reason).inc()
        raise
    context.principal = who  # its best role labels the request's metrics (MeterMiddleware)
    return who


def _api_key(authorization: str | None) -> str | None:
    """The bearer credential if it is an API key (appliance.api_keys), else None."""
    scheme, _, credential = (authorization or "").partition(" ")
    credential = credential.strip()
    return credential if scheme.lower() == "bearer" and looks_like_key(credential) else None


def batch_principal(request: Request, reference: str) -> Principal:
    """The owner of a batch request the batch-worker sends (`BATCH_HEADER`: "<batch id>:<line>"),
    with the roles they held when they created the batch (the caller keeps those they still hold).
    Only with the worker's key, only for a request claimed now and only on the relay's routes: the
    worker can act for no one else, nowhere else. The request's audit record names the batch
    request."""
    home = request.app.state.home
    key = _worker_key(home)
    given = request.headers.get("authorization") or ""
    if not hmac.compare_digest(given.encode("utf-8", "surrogatepass"), f"Bearer {key}".encode()):
        raise AuthError("invalid_token", "batch requests need the batch worker's key")
    batch_id, _, line = reference.partition(":")
    if request.url.path not in batches.ENDPOINTS or not (line.isascii() and line.isdigit()) or \
            not batches.is_claimed(home, batch_id, int(line)):
        raise AuthError("invalid_token", "no such batch request in progress", status=403)
    owner, _ = batches.owner_of(home, batch_id)
    context_of(request).batch = reference
    if owner.key is None:
        return Principal(subject=owner.subject, username=owner.username, client="batch-worker", roles=owner.roles,
                         token_id=reference, expires_at=float("inf"))
    # Made with an API key: its requests stop when the key is revoked or expires, within its limits.
    try:
        key = request.app.state.gateway.keys.named(owner.username, owner.key)
    except AuthError as exc:
        if exc.status != 401:
            raise  # the registry unreadable (503): the worker gives the request back and retries
        # 403, not 401: the worker's own key is good (a 401 makes every batch wait); this request fails.
        raise AuthError(exc.reason, exc.message, status=403) from exc
    return Principal.for_key(key, subject=owner.subject, roles=owner.roles, client="batch-worker", token_id=reference,
                             expires_at=float("inf"))


@functools.cache
def _worker_key(home: Home) -> str:
    """The batch-worker's key (made by `up`), read once."""
    return secret(home, BATCH_WORKER_SECRET)


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
