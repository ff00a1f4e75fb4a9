"""Tokens of the shape Keycloak issues, unsigned, for tests of what reads them locally (whoami and
status never check a signature: the gateway does)."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

from appliance import connection as connections
from appliance import login
from appliance.connection import Connection
from appliance.home import Home
from appliance.settings import Settings

ISSUER = "https://127.0.0.1:8443/realms/appliance"


def jwt(**claims: Any) -> str:
    """An unsigned token carrying `claims`."""
    def part(value: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()
    return f"{part({'alg': 'RS256', 'typ': 'JWT'})}.{part(claims)}.c2lnbmF0dXJl"


def admin_token(username: str = "admin", roles: tuple[str, ...] = ("admin", "offline_access"),
                access_s: float = 300, refresh_s: float = 1800) -> login.CachedToken:
    """A cached login of `username` with `roles`, its tokens expiring in the given seconds."""
    now = time.time()
    access = jwt(preferred_username=username, sub="0b5c-uuid", azp="appliance-cli", iss=ISSUER,
                 realm_access={"roles": list(roles)}, exp=int(now + access_s))
    return login.CachedToken(username=username, access_token=access, refresh_token="refresh",
                             expires_at=now + access_s, refresh_expires_at=now + refresh_s)


def here(home: Home) -> Connection:
    """This host's appliance at `home` with default settings: where its CLI logs in."""
    return connections.local(Settings(), home)
