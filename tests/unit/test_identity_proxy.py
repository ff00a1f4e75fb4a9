"""Keycloak published through the gateway, short of a running Keycloak (a stand-in answers): only
the login endpoints of the appliance's realm are forwarded, with only the headers a login needs
and the client's address; everything else under /realms/ and /resources/ is a 404, and the
discovery document says where to log in."""

from __future__ import annotations

import asyncio
import types
from collections.abc import Callable, Iterator

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from appliance.settings import GatewaySettings, Settings
from serve.errors import GatewayError
from serve.identity_proxy import IdentityProxy, router

PUBLIC = "https://llm.bank.test:8443"
SETTINGS = Settings(gateway=GatewaySettings(bind="0.0.0.0", public_url=PUBLIC))


@pytest.fixture
def seen() -> list[httpx.Request]:
    return []


@pytest.fixture
def client(seen: list[httpx.Request]) -> Iterator[TestClient]:
    def keycloak(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(302, headers=[("location", f"{PUBLIC}/realms/appliance/login-actions/authenticate"),
                                            ("set-cookie", "AUTH_SESSION_ID=a; Path=/realms/appliance/; Secure"),
                                            ("set-cookie", "KC_RESTART=b; Path=/realms/appliance/; Secure"),
                                            ("connection", "close")], content=b"moved")

    with TestClient(published(keycloak), base_url=PUBLIC, follow_redirects=False) as test_client:
        yield test_client


def published(keycloak: Callable[[httpx.Request], httpx.Response]) -> FastAPI:
    """The published routes in an app of their own, `keycloak` answering behind them."""
    app = FastAPI()
    app.state.gateway = types.SimpleNamespace(
        identity=IdentityProxy(SETTINGS, httpx.AsyncClient(transport=httpx.MockTransport(keycloak))))

    @app.exception_handler(GatewayError)
    async def refused(_: object, exc: GatewayError) -> object:
        return exc.response()

    app.include_router(router(SETTINGS))
    return app


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/realms/appliance/protocol/openid-connect/token"),
    ("POST", "/realms/appliance/protocol/openid-connect/auth/device"),
    ("GET", "/realms/appliance/protocol/openid-connect/certs"),
    ("GET", "/realms/appliance/device?user_code=ABCD-EFGH"),
    ("POST", "/realms/appliance/login-actions/authenticate?session_code=x&execution=y"),
    ("GET", "/resources/abc12/login/keycloak.v2/css/styles.css"),
])
def test_the_login_endpoints_are_forwarded_with_the_clients_address(
        client: TestClient, seen: list[httpx.Request], method: str, path: str) -> None:
    answer = client.request(method, path, content=b"a=1", headers={
        "Authorization": "Bearer gateway-token", "X-Forwarded-For": "6.6.6.6", "Cookie": "KC_RESTART=b",
        "X-Custom": "x"})
    assert answer.status_code == 302 and answer.headers["location"].startswith(PUBLIC)
    assert answer.headers.get_list("set-cookie") == ["AUTH_SESSION_ID=a; Path=/realms/appliance/; Secure",
                                                     "KC_RESTART=b; Path=/realms/appliance/; Secure"]
    [request] = seen
    assert str(request.url).startswith(f"{SETTINGS.keycloak.base_url}/") and request.url.raw_path.decode() == path
    assert request.headers["x-forwarded-for"] == "testclient"  # the peer, never what the client claimed
    assert "authorization" not in request.headers and "x-custom" not in request.headers
    assert request.headers["cookie"] == "KC_RESTART=b"


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/realms/master/protocol/openid-connect/certs"),
    ("POST", "/realms/master/protocol/openid-connect/token"),
    ("POST", "/realms/appliance/protocol/openid-connect/token/introspect"),
    ("GET", "/realms/appliance/protocol/openid-connect/userinfo"),
    ("GET", "/realms/appliance/account"),
    ("GET", "/realms/appliance/clients-registrations/default"),
    ("GET", "/realms/appliance/protocol/openid-connect/certs/../../../../admin/realms"),
    ("GET", "/realms/appliance/protocol/openid-connect/%2e%2e/%2e%2e/account"),
    ("GET", "/realms/appliance/login-actions/%2F..%2F..%2Fmaster"),
    ("GET", "/realms/appliance/device/..%2f..%2fmaster"),
    ("GET", "/resources/../admin/master/console/"),
    ("GET", "/resources/%2e%2e/admin"),
    ("PUT", "/realms/appliance/protocol/openid-connect/token"),
    ("DELETE", "/realms/appliance/device"),
    ("GET", "/realms/Appliance/protocol/openid-connect/certs"),
    ("GET", "/realms/appliance/protocol/openid-connect/certs;x=y"),
    ("GET", "/realms/appliance//protocol/openid-connect/certs"),
])
def test_everything_else_is_not_published(client: TestClient, seen: list[httpx.Request], method: str,
                                          path: str) -> None:
    answer = client.request(method, path)
    assert answer.status_code in (404, 405), answer.text
    assert seen == []


def test_discovery_says_where_to_log_in(client: TestClient) -> None:
    assert client.get("/.well-known/appliance").json() == {
        "issuer": f"{PUBLIC}/realms/appliance", "realm_path": "/realms/appliance", "client_id": "appliance-cli",
        "published": True}


def test_nothing_is_published_without_a_public_url() -> None:
    app = FastAPI()
    app.include_router(router(Settings()))
    with TestClient(app) as local:
        assert local.get("/realms/appliance/protocol/openid-connect/certs").status_code == 404
        assert local.get("/.well-known/appliance").json()["published"] is False


def test_keycloak_down_is_a_503_naming_it(seen: list[httpx.Request]) -> None:
    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    with TestClient(published(down)) as test_client:
        answer = test_client.post("/realms/appliance/protocol/openid-connect/token")
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "keycloak_unavailable"


@pytest.mark.parametrize("path", [
    "/resources/../admin/realms/master/users", "/resources/x/../../admin/master/console/index.html",
    "/resources/../realms/master/protocol/openid-connect/auth", "/resources/..", "/resources/.", "/resources/./x",
    "/resources/a/./b", "/realms/appliance/login-actions/..", "/realms/appliance/device/../../master/device",
])
def test_dot_segments_are_never_forwarded_as_the_client_sent_them(path: str, seen: list[httpx.Request]) -> None:
    """A path as the client sent it (no library in between normalising it): a dot segment would
    be resolved by the proxy's own HTTP client or by Keycloak into another path than the one checked."""
    proxy = IdentityProxy(SETTINGS, httpx.AsyncClient(transport=httpx.MockTransport(
        lambda request: seen.append(request) or httpx.Response(200))))
    assert not proxy.permits("GET", path)
    scope = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [], "client": ("10.0.0.9", 5000), "server": ("llm.bank.test", 8443), "scheme": "https"}
    with pytest.raises(GatewayError) as refused:
        asyncio.run(proxy.forward(Request(scope)))
    assert refused.value.status == 404 and seen == []
