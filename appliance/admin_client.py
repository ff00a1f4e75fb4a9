"""The one client of the gateway's admin API, for the CLI (blocking calls) and the TUI (async, so
its screens never wait): one notion of where the gateway is, one login (the cached Keycloak token,
refreshed near its expiry; or, for the TUI, a session of its own taken from it at start) and one
reading of its answers."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from appliance import login
from appliance.connection import Connection
from appliance.errors import ApplianceError, Unavailable


class Unreachable(Unavailable):
    """The gateway (or Keycloak, for a refresh) does not answer: stopped, restarting, or down."""

    code = "gateway_unreachable"


class NotLoggedIn(ApplianceError):
    """No cached login, or it expired and cannot be refreshed: log in again."""

    code = "not_logged_in"


class Refused(ApplianceError):
    """The gateway answered with an error; `reason` is its message."""

    code = "refused"

    def __init__(self, status: int, reason: str, request: str = "", *, hint: str | None = None) -> None:
        super().__init__(f"{request}: {status} {reason}" if request else f"{status} {reason}", hint=hint)
        self.status = status
        self.reason = reason


CLI_AGAIN = "log in again: `appliance token`"  # how the CLI's cached login is made again


def _answer(response: httpx.Response, method: str, path: str, token: login.CachedToken,
            again: str = CLI_AGAIN) -> Any:
    if response.status_code == 401:
        raise NotLoggedIn(f"the gateway refused the login as {token.username} (expired or revoked)", hint=again)
    if response.status_code >= 400:
        try:
            reason = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            reason = response.text[:300]
        # A 403 is the login's roles: say whose, so a token of another user is noticed.
        hint = (f"{_who(token)}: log in as a user with the role it needs (`appliance token`)"
                if response.status_code == 403 else None)
        raise Refused(response.status_code, str(reason), f"{method} /admin{path}", hint=hint)
    return response.json()


def _who(token: login.CachedToken) -> str:
    """'logged in as alice (roles: user)', from the cached token's own claims."""
    try:
        roles = login.realm_roles(login.token_claims(token.access_token))
    except login.LoginError:
        return f"logged in as {token.username} (roles unreadable)"
    return f"logged in as {token.username} (roles: {', '.join(roles) or 'none'})"


class AdminClient:
    """Calls to /admin with a bearer token from the login cache, or from `session` when given (a
    long-running program's own login, which a later login at the CLI leaves as it is)."""

    def __init__(self, connection: Connection, timeout_s: float = 60.0, session: login.Session | None = None) -> None:
        self.connection = connection
        self.session = session
        self.again = session.again if session is not None else CLI_AGAIN
        self.base_url = connection.gateway
        self.timeout_s = timeout_s
        self._http: httpx.AsyncClient | None = None  # made on the first async call (the CLI makes none)

    def _async_http(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(**self.connection.async_gateway_options(), timeout=self.timeout_s)
        return self._http

    def _token(self) -> login.CachedToken:
        try:
            return self.session.token() if self.session is not None else login.current_token(self.connection)
        except login.KeycloakUnreachable as exc:  # a refresh to try again, not a login that ended
            raise Unreachable(exc.message, hint=exc.hint) from exc
        except login.LoginError as exc:
            raise NotLoggedIn(exc.one_line()) from exc

    def _unreachable(self, exc: httpx.HTTPError) -> Unreachable:
        return Unreachable(f"the gateway at {self.base_url} does not answer ({type(exc).__name__})",
                           hint="is the appliance up? (`appliance status`)")

    def call_sync(self, method: str, path: str, **kwargs: Any) -> Any:
        """`method /admin{path}`'s JSON body (blocking); Refused, NotLoggedIn or Unreachable otherwise."""
        token = self._token()
        try:
            with httpx.Client(**self.connection.gateway_options(), timeout=self.timeout_s) as http:
                response = http.request(method, f"/admin{path}", **kwargs,
                                        headers={"Authorization": f"Bearer {token.access_token}"})
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc
        return _answer(response, method, path, token, self.again)

    async def call(self, method: str, path: str, **kwargs: Any) -> Any:
        """As `call_sync`, without blocking the event loop (a token refresh runs in a thread)."""
        token = await asyncio.to_thread(self._token)
        try:
            response = await self._async_http().request(method, f"/admin{path}", **kwargs,
                                                headers={"Authorization": f"Bearer {token.access_token}"})
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc
        return _answer(response, method, path, token, self.again)

    async def username(self) -> str:
        return (await asyncio.to_thread(self._token)).username

    async def metrics_text(self) -> str:
        """The gateway's Prometheus exposition (an administrator's login)."""
        token = await asyncio.to_thread(self._token)
        try:
            response = await self._async_http().get("/metrics",
                                                    headers={"Authorization": f"Bearer {token.access_token}"})
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc
        if response.status_code == 401:
            raise NotLoggedIn(f"the gateway refused the login as {token.username} (expired or revoked)",
                              hint=self.again)
        if response.status_code != 200:
            raise Refused(response.status_code, response.text[:300], "GET /metrics", hint=_who(token))
        return response.text

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
