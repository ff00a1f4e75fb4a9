"""The TUI's only way into the appliance: the gateway's REST admin API (and its /metrics), with
the cached Keycloak login, asynchronously so the screens never wait on it."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from appliance import login
from appliance.home import Home
from appliance.settings import Settings


class Unreachable(Exception):
    """The gateway does not answer (stopped, restarting, or the appliance is down)."""


class NotLoggedIn(Exception):
    """No cached login, or it expired and cannot be refreshed: log in again."""


class Refused(Exception):
    """The gateway answered with an error; its message says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class AdminClient:
    """Calls to /admin with a bearer token from the login cache (refreshed when near expiry)."""

    def __init__(self, settings: Settings, home: Home, timeout_s: float = 30.0) -> None:
        self.settings = settings
        self.home = home
        gateway = settings.gateway
        host = "127.0.0.1" if gateway.bind in ("0.0.0.0", "::") else gateway.bind
        self.base_url = f"http://{host}:{gateway.port}"
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s)

    async def close(self) -> None:
        await self._http.aclose()

    async def username(self) -> str:
        return (await self._token()).username

    async def _token(self) -> login.CachedToken:
        try:  # a refresh is a blocking HTTP call to Keycloak: off the UI's event loop
            return await asyncio.to_thread(login.current_token, self.settings, self.home)
        except login.LoginError as exc:
            raise NotLoggedIn(exc.one_line()) from exc
        except httpx.HTTPError as exc:
            raise Unreachable(f"Keycloak at {self.settings.keycloak.issuer} does not answer: {exc}") from exc

    async def call(self, method: str, path: str, **kwargs: Any) -> Any:
        """`method /admin{path}`'s JSON body; Refused, NotLoggedIn or Unreachable otherwise."""
        token = await self._token()
        try:
            response = await self._http.request(method, f"/admin{path}", **kwargs,
                                                headers={"Authorization": f"Bearer {token.access_token}"})
        except httpx.HTTPError as exc:
            raise Unreachable(f"the gateway at {self.base_url} does not answer ({type(exc).__name__})") from exc
        if response.status_code == 401:
            raise NotLoggedIn("the gateway refused the login (expired or revoked)")
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:300]
            raise Refused(response.status_code, message)
        return response.json()

    async def metrics_text(self) -> str:
        """The gateway's Prometheus exposition (no login needed)."""
        try:
            response = await self._http.get("/metrics")
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise Unreachable(f"the gateway at {self.base_url} does not answer ({type(exc).__name__})") from exc
        return response.text
