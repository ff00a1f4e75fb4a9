"""The CLI's device login polls Keycloak until the person approves: Keycloak's `slow_down` and the
gateway's per-source login throttle (429) make it wait longer, never fail the login."""

from __future__ import annotations

import ssl
from typing import Any

import httpx
import pytest

from appliance import login
from appliance.connection import Connection

ISSUER = "https://gw.example:8443/realms/appliance"
GRANT = {"device_code": "dc", "user_code": "ABCD-EFGH", "verification_uri": f"{ISSUER}/device",
         "interval": 1, "expires_in": 600}
TOKEN = {"access_token": "x.eyJwcmVmZXJyZWRfdXNlcm5hbWUiOiJhbGljZSJ9.y", "expires_in": 60,
         "refresh_token": "r", "refresh_expires_in": 600}


def connection() -> Connection:
    def trust() -> ssl.SSLContext | bool:
        return True
    return Connection(gateway="https://gw.example:8443", realm_url=ISSUER, issuer=ISSUER, client_id="appliance-cli",
                      remote=True, keycloak_trust=trust, gateway_options=dict, async_gateway_options=dict)


@pytest.mark.parametrize("answers, waits", [
    ([httpx.Response(429, json={"error": {"code": "throttled"}}, headers={"Retry-After": "2"}),
      httpx.Response(200, json=TOKEN)], [1.0, 6.0]),
    ([httpx.Response(400, json={"error": "slow_down"}), httpx.Response(400, json={"error": "authorization_pending"}),
      httpx.Response(200, json=TOKEN)], [1.0, 6.0, 6.0]),
])
def test_a_throttled_poll_waits_longer_and_the_login_goes_on(monkeypatch: pytest.MonkeyPatch,
                                                             answers: list[httpx.Response], waits: list[float]) -> None:
    posted: list[str] = []
    slept: list[float] = []

    def post(_connection: Connection, name: str, data: dict[str, str]) -> httpx.Response:
        posted.append(name)
        return httpx.Response(200, json=GRANT) if name == "auth/device" else answers.pop(0)

    saved: list[Any] = []
    monkeypatch.setattr(login, "_post", post)
    monkeypatch.setattr(login, "save", lambda _connection, token: saved.append(token))
    monkeypatch.setattr("appliance.login.time.sleep", slept.append)
    token = login.device_login(connection(), lambda _link, _code: None)
    assert token.username == "alice" and saved == [token]
    assert slept == waits and not answers


def test_another_refusal_while_polling_fails_the_login(monkeypatch: pytest.MonkeyPatch) -> None:
    def post(_connection: Connection, name: str, data: dict[str, str]) -> httpx.Response:
        return (httpx.Response(200, json=GRANT) if name == "auth/device"
                else httpx.Response(400, json={"error": "access_denied", "error_description": "denied"}))

    monkeypatch.setattr(login, "_post", post)
    monkeypatch.setattr("appliance.login.time.sleep", lambda _s: None)
    with pytest.raises(login.LoginError, match="denied"):
        login.device_login(connection(), lambda _link, _code: None)
