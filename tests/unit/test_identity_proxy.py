"""Keycloak published through the gateway, short of a running Keycloak (a stand-in answers): only
the login endpoints of the appliance's realm are forwarded, with only the headers a login needs
and the client's address; everything else under /realms/ and /resources/ is a 404, and the
discovery document says where to log in. Each request stands alone: clients interleaved through
every published flow see only their own cookies; a body past its route's bound is a 413 before it
is read; only the appliance's own client logs in; a source past its attempts is a 429, recorded."""

from __future__ import annotations

import asyncio
import types
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.settings import GatewaySettings, Settings
from audit import AuditEvent, AuditUnavailable
from serve.errors import GatewayError
from serve.identity_proxy import ROUTES, IdentityProxy, router
from serve.keycloak_http import keycloak_client, no_cookies

PUBLIC = "https://llm.bank.test:8443"
SETTINGS = Settings(gateway=GatewaySettings(bind="0.0.0.0", public_url=PUBLIC, login_burst=1000))
CLIENT = "client_id=appliance-cli"
FORM = {"content-type": "application/x-www-form-urlencoded"}


async def not_recorded(event: AuditEvent) -> None:
    raise AssertionError(f"nothing is refused here: {event}")


def proxy_to(keycloak: Callable[[httpx.Request], httpx.Response], settings: Settings = SETTINGS,
             record: Callable[[AuditEvent], Any] = not_recorded) -> IdentityProxy:
    """The proxy as the gateway makes it (its own client, no cookies kept), `keycloak` behind it."""
    return IdentityProxy(settings, keycloak_client(False, 1.0, transport=httpx.MockTransport(keycloak)), record)


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


def noting(seen: list[httpx.Request]) -> Callable[[httpx.Request], httpx.Response]:
    """A stand-in Keycloak that notes each request it gets and answers 200."""
    def keycloak(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200)
    return keycloak


def published(keycloak: Callable[[httpx.Request], httpx.Response], settings: Settings = SETTINGS,
              record: Callable[[AuditEvent], Any] = not_recorded) -> FastAPI:
    """The published routes in an app of their own, `keycloak` answering behind them."""
    app = FastAPI()
    app.state.gateway = types.SimpleNamespace(identity=proxy_to(keycloak, settings, record))

    @app.exception_handler(GatewayError)
    async def refused(_: object, exc: GatewayError) -> object:
        return exc.response()

    app.include_router(router(settings))
    return app


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/realms/appliance/protocol/openid-connect/token", f"grant_type=password&{CLIENT}"),
    ("POST", "/realms/appliance/protocol/openid-connect/auth/device", CLIENT),
    ("POST", "/realms/appliance/protocol/openid-connect/revoke", f"token=x&{CLIENT}"),
    ("GET", "/realms/appliance/protocol/openid-connect/certs", ""),
    ("GET", f"/realms/appliance/protocol/openid-connect/auth?{CLIENT}&response_type=code", ""),
    ("GET", "/realms/appliance/device?user_code=ABCD-EFGH", ""),
    ("POST", "/realms/appliance/device", "user_code=ABCD-EFGH"),
    ("GET", "/realms/appliance/device/status", ""),
    ("GET", f"/realms/appliance/login-actions/required-action?execution=OAUTH_GRANT&{CLIENT}&tab_id=t", ""),
    ("POST", f"/realms/appliance/login-actions/authenticate?session_code=x&execution=y&{CLIENT}", "username=a"),
    ("GET", "/resources/abc12/login/keycloak.v2/css/styles.css", ""),
])
def test_the_login_endpoints_are_forwarded_with_the_clients_address(
        client: TestClient, seen: list[httpx.Request], method: str, path: str, body: str) -> None:
    answer = client.request(method, path, content=body.encode(), headers={
        "Authorization": "Bearer gateway-token", "X-Forwarded-For": "6.6.6.6", "Cookie": "KC_RESTART=b",
        "X-Custom": "x", **FORM})
    assert answer.status_code == 302 and answer.headers["location"].startswith(PUBLIC)
    assert answer.headers.get_list("set-cookie") == ["AUTH_SESSION_ID=a; Path=/realms/appliance/; Secure",
                                                     "KC_RESTART=b; Path=/realms/appliance/; Secure"]
    [request] = seen
    assert str(request.url).startswith(f"{SETTINGS.keycloak.base_url}/") and request.url.raw_path.decode() == path
    assert request.headers["x-forwarded-for"] == "testclient"  # the peer, never what the client claimed
    assert "authorization" not in request.headers and "x-custom" not in request.headers
    assert request.headers["cookie"] == "KC_RESTART=b" and request.content == body.encode()


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
    ("GET", "/realms/appliance/device/status/x"),
    ("POST", "/realms/appliance/device/status"),
    ("GET", "/realms/appliance/device/other"),
    ("POST", "/realms/appliance/protocol/openid-connect/logout"),
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
        answer = test_client.post("/realms/appliance/protocol/openid-connect/token", content=CLIENT, headers=FORM)
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "keycloak_unavailable"


@pytest.mark.parametrize("path", [
    "/resources/../admin/realms/master/users", "/resources/x/../../admin/master/console/index.html",
    "/resources/../realms/master/protocol/openid-connect/auth", "/resources/..", "/resources/.", "/resources/./x",
    "/resources/a/./b", "/realms/appliance/login-actions/..", "/realms/appliance/device/../../master/device",
])
def test_dot_segments_are_never_forwarded_as_the_client_sent_them(path: str, seen: list[httpx.Request]) -> None:
    """A path as the client sent it (no library in between normalising it): a dot segment would
    be resolved by the proxy's own HTTP client or by Keycloak into another path than the one checked."""
    proxy = proxy_to(noting(seen))
    assert not proxy.permits("GET", path)
    scope = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [], "client": ("10.0.0.9", 5000), "server": ("llm.bank.test", 8443), "scheme": "https"}
    with pytest.raises(GatewayError) as refused:
        asyncio.run(proxy.forward(Request(scope)))
    assert refused.value.status == 404 and seen == []


# Every published flow, step by step, as a client sends it (method, path and query, form).
FLOWS: dict[str, list[tuple[str, str, str]]] = {
    "password": [("POST", "protocol/openid-connect/token", f"grant_type=password&username=u&password=p&{CLIENT}")],
    "device": [("POST", "protocol/openid-connect/auth/device", CLIENT),
               ("GET", "device?user_code=ABCD-EFGH", ""),
               ("POST", "device", "user_code=ABCD-EFGH"),
               ("POST", f"login-actions/authenticate?session_code=s&execution=e&{CLIENT}&tab_id=t",
                "username=u&password=p"),
               ("POST", f"login-actions/consent?{CLIENT}&tab_id=t", "accept=Yes"),
               ("GET", "device/status", ""),
               ("POST", "protocol/openid-connect/token",
                f"grant_type=urn:ietf:params:oauth:grant-type:device_code&device_code=d&{CLIENT}")],
    "browser login": [("GET", f"protocol/openid-connect/auth?{CLIENT}&response_type=code&redirect_uri=x", ""),
                      ("GET", f"login-actions/authenticate?{CLIENT}&tab_id=t", ""),
                      ("POST", f"login-actions/authenticate?session_code=s&execution=e&{CLIENT}&tab_id=t",
                       "username=u&password=p")],
    "refresh": [("POST", "protocol/openid-connect/token", f"grant_type=refresh_token&refresh_token=r&{CLIENT}")],
    "logout": [("POST", "protocol/openid-connect/revoke", f"token=r&token_type_hint=refresh_token&{CLIENT}")],
}
STEPS = [step for steps in FLOWS.values() for step in steps]


class SessionKeycloak:
    """A stand-in Keycloak that starts a session (a cookie no one else has) on every answer, as the
    real one does on a login page, and notes the cookies each request carried and for whom."""

    def __init__(self) -> None:
        self.issued: dict[str, str] = {}  # cookie value -> the client (user agent) it was set for
        self.seen: list[tuple[str, str]] = []  # (the client, the Cookie header Keycloak got)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        who = request.headers["user-agent"]
        self.seen.append((who, request.headers.get("cookie", "")))
        value = f"{who}-{len(self.issued)}"
        self.issued[value] = who
        return httpx.Response(200, headers=[
            ("set-cookie", f"KEYCLOAK_IDENTITY={value}; Path=/realms/appliance/; Secure; HttpOnly"),
            ("set-cookie", f"AUTH_SESSION_ID={value}; Path=/realms/appliance/; Secure")], content=b"page")


@given(st.lists(st.tuples(st.sampled_from(["browser", "anonymous", "script"]), st.sampled_from(STEPS)),
                min_size=1, max_size=40))
@settings(max_examples=60, deadline=None)
def test_interleaved_clients_see_only_their_own_keycloak_session(
        moves: list[tuple[str, tuple[str, str, str]]]) -> None:
    """Three clients through every published flow in any interleaving: a browser keeping its
    cookies, and two that keep none. Keycloak sees on each request only cookies it set for that
    client, and the clients that keep none never send Keycloak a cookie, however many sessions the
    browser started before them."""
    keycloak = SessionKeycloak()
    app = published(keycloak)
    clients = {"browser": TestClient(app, base_url=PUBLIC),
               "anonymous": TestClient(app, base_url=PUBLIC, cookies=no_cookies()),
               "script": TestClient(app, base_url=PUBLIC, cookies=no_cookies())}
    for who, (method, path, form) in moves:
        answer = clients[who].request(method, f"/realms/appliance/{path}", content=form.encode(),
                                      headers={"user-agent": who, **FORM})
        assert answer.status_code == 200, answer.text
        assert all(value.split(";")[0].split("=", 1)[1].startswith(f"{who}-")
                   for value in answer.headers.get_list("set-cookie")), "a session set for someone else"
    for who, cookie in keycloak.seen:
        sent = [part.split("=", 1)[1] for part in cookie.split("; ") if part]
        assert all(keycloak.issued[value] == who for value in sent), (who, cookie)
        if who != "browser":
            assert cookie == "", f"{who} keeps no cookie, yet Keycloak got {cookie!r}"


def test_the_gateways_keycloak_clients_keep_no_cookie() -> None:
    """The class, not only the proxy: every client serve.keycloak_http makes (the keys,
    introspection and the event poller share one) drops Keycloak's Set-Cookie."""
    got: list[str | None] = []

    def keycloak(request: httpx.Request) -> httpx.Response:
        got.append(request.headers.get("cookie"))
        return httpx.Response(200, headers=[("set-cookie", "KEYCLOAK_IDENTITY=admin; Path=/; Secure"),
                                            ("set-cookie", "sticky=1; Domain=127.0.0.1; Path=/")])

    async def twice() -> httpx.Cookies:
        async with keycloak_client(False, 1.0, transport=httpx.MockTransport(keycloak)) as http:
            await http.get(f"{SETTINGS.keycloak.base_url}/realms/appliance/protocol/openid-connect/certs")
            await http.get(f"{SETTINGS.keycloak.base_url}/realms/appliance/protocol/openid-connect/certs")
            return http.cookies

    jar = asyncio.run(twice())
    assert got == [None, None] and len(jar.jar) == 0


@pytest.mark.parametrize("route", [r for r in ROUTES if r.max_body], ids=lambda r: f"{r.method} {r.path.pattern}")
@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_body_past_its_routes_bound_is_refused_before_keycloak(seen: list[httpx.Request], route: Any,
                                                                 declared: bool) -> None:
    """Each route reads at most what its Keycloak form needs: by its Content-Length before a byte is
    read, or while a chunked body arrives; nothing reaches Keycloak, and the connection closes."""
    path = {"login-actions/[a-z-]+": "login-actions/authenticate"}.get(route.path.pattern, route.path.pattern)
    fill = f"{CLIENT}&x=".encode()
    body = fill + b"a" * (route.max_body + 1 - len(fill))
    content = body if declared else iter([body[:100], body[100:]])
    with TestClient(published(noting(seen))) as test_client:
        answer = test_client.request("POST", f"/realms/appliance/{path}?{CLIENT}", content=content, headers=FORM)
        assert answer.status_code == 413 and answer.json()["error"]["code"] == "request_too_large"
        assert str(route.max_body) in answer.json()["error"]["message"]
        assert answer.headers["connection"] == "close" and seen == []
        fits = test_client.request("POST", f"/realms/appliance/{path}?{CLIENT}", content=body[:-1], headers=FORM)
        assert fits.status_code == 200 and len(seen) == 1


@pytest.mark.parametrize("path", ["/realms/appliance/protocol/openid-connect/certs", "/realms/appliance/device",
                                  "/resources/abc12/login/keycloak.v2/css/styles.css"])
def test_a_body_where_none_is_needed_is_refused(client: TestClient, seen: list[httpx.Request], path: str) -> None:
    assert client.request("GET", path, content=b"x" * 10).status_code == 413 and seen == []


@pytest.mark.parametrize("query", ["", "client_id=account-console", "client_id=security-admin-console",
                                   "client_id=admin-cli", "client_id=appliance-gateway", "client_id=",
                                   "client_id=appliance-cli&client_id=account-console",
                                   "client%5Fid=account-console&client_id=appliance-cli",
                                   "client_id=APPLIANCE-CLI"])
@pytest.mark.parametrize("path", ["protocol/openid-connect/auth", "login-actions/authenticate",
                                  "login-actions/required-action"])
def test_only_the_appliances_client_has_login_pages_here(client: TestClient, seen: list[httpx.Request],
                                                         path: str, query: str) -> None:
    """Keycloak's admin and account consoles, its other clients and any client not named once
    exactly: a 400 naming client_id, and no page from Keycloak."""
    answer = client.get(f"/realms/appliance/{path}?response_type=code&{query}")
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "client_id", answer.text
    assert seen == []


@pytest.mark.parametrize("form", ["grant_type=password&username=u&password=p",
                                  "grant_type=password&client_id=appliance-gateway&client_secret=s",
                                  "grant_type=client_credentials&client_id=appliance-rl&client_secret=s",
                                  "client_id=appliance-cli&client_id=admin-cli", "client_id=account-console"])
@pytest.mark.parametrize("path", ["protocol/openid-connect/token", "protocol/openid-connect/auth/device",
                                  "protocol/openid-connect/revoke"])
def test_only_the_appliances_client_gets_tokens_here(client: TestClient, seen: list[httpx.Request], path: str,
                                                     form: str) -> None:
    answer = client.post(f"/realms/appliance/{path}", content=form, headers=FORM)
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "unknown_client", answer.text
    assert seen == []


@pytest.mark.parametrize(("content_type", "body"), [
    ("application/json", b'{"client_id": "appliance-cli"}'), ("", b"client_id=appliance-cli"),
    ("multipart/form-data; boundary=x", b"--x\r\nContent-Disposition: form-data; name=\"client_id\"\r\n\r\n"
                                        b"account-console\r\n--x--\r\n")])
def test_a_token_request_is_a_form_or_nothing(client: TestClient, seen: list[httpx.Request], content_type: str,
                                              body: bytes) -> None:
    """What is checked is what Keycloak reads: a body the check cannot read as a form is refused."""
    answer = client.post("/realms/appliance/protocol/openid-connect/token", content=body,
                         headers={"content-type": content_type} if content_type else {})
    assert answer.status_code == 415 and seen == []


def test_a_source_past_its_attempts_is_throttled_and_recorded(seen: list[httpx.Request]) -> None:
    """Login attempts per source: past the burst a 429 with Retry-After, recorded as a refusal of the
    source; the keys and the pages' resources are no attempts; the body of a refused one is not read."""
    recorded: list[AuditEvent] = []

    async def record(event: AuditEvent) -> None:
        recorded.append(event)

    tight = Settings(gateway=GatewaySettings(bind="0.0.0.0", public_url=PUBLIC, login_burst=3,
                                             login_attempts_per_minute=1))
    app = published(noting(seen), tight, record)
    token = "/realms/appliance/protocol/openid-connect/token"
    with TestClient(app) as test_client:
        answers = [test_client.post(token, content=f"grant_type=password&{CLIENT}", headers=FORM) for _ in range(5)]
        assert [a.status_code for a in answers] == [200, 200, 200, 429, 429]
        refused = answers[3]
        assert refused.json()["error"]["code"] == "login_rate_exceeded" and int(refused.headers["retry-after"]) > 0
        for path in ("/realms/appliance/device?user_code=X", f"/realms/appliance/login-actions/authenticate?{CLIENT}"):
            assert test_client.get(path).status_code == 429
        assert test_client.post(token, content=b"x" * 100_000, headers=FORM).status_code == 429  # not 413: unread
        assert test_client.get("/realms/appliance/protocol/openid-connect/certs").status_code == 200
        assert test_client.get("/resources/abc12/login/keycloak.v2/css/styles.css").status_code == 200
    assert len(seen) == 5
    assert {(e.action, e.outcome, e.status, e.source, e.reason) for e in recorded} == {
        ("identity.throttled", "denied", 429, "testclient", "login_rate_exceeded")}
    assert len(recorded) == 5 and recorded[0].resource == token


def test_a_throttled_attempt_the_audit_log_cannot_take_is_a_503() -> None:
    async def unavailable(event: AuditEvent) -> None:
        raise AuditUnavailable("disk full")

    tight = Settings(gateway=GatewaySettings(bind="0.0.0.0", public_url=PUBLIC, login_burst=1))
    with TestClient(published(lambda request: httpx.Response(200), tight, unavailable)) as test_client:
        first = test_client.post("/realms/appliance/protocol/openid-connect/token", content=CLIENT, headers=FORM)
        second = test_client.post("/realms/appliance/protocol/openid-connect/token", content=CLIENT, headers=FORM)
    assert first.status_code == 200
    assert second.status_code == 503 and second.json()["error"]["code"] == "audit_unavailable"


TOKEN = "/realms/appliance/protocol/openid-connect/token"


@pytest.mark.parametrize("content_types", [
    ["application/x-www-form-urlencoded", "multipart/form-data; boundary=X"],
    ["multipart/form-data; boundary=X", "application/x-www-form-urlencoded"],
    ["application/x-www-form-urlencoded", "application/x-www-form-urlencoded"],
])
def test_a_header_given_twice_is_refused_not_checked_once_and_forwarded_as_the_other(
        client: TestClient, seen: list[httpx.Request], content_types: list[str]) -> None:
    """The proxy reads one header, Keycloak another: a form checked, a multipart body naming
    another client forwarded."""
    body = (b"client_id=appliance-cli&x=--X\r\nContent-Disposition: form-data; name=\"client_id\"\r\n\r\n"
            b"account-console\r\n--X--\r\n")
    answer = client.post(TOKEN, content=body, headers=[("content-type", kind) for kind in content_types])
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "content-type", answer.text
    assert seen == []


@pytest.mark.parametrize("parameters", ["; charset=UTF-16", "; charset=utf-16le", ";charset=ISO-8859-1",
                                        "; charset=utf-7", "; charset=cp1047", "; charset=utf-8; boundary=x",
                                        "; charset=utf-8, multipart/form-data"])
def test_a_form_in_another_charset_is_refused(client: TestClient, seen: list[httpx.Request], parameters: str) -> None:
    """Keycloak would read other fields than the proxy's UTF-8 check in another charset's bytes."""
    answer = client.post(TOKEN, content=b"grant_type=password&client_id=appliance-cli",
                         headers={"content-type": f"application/x-www-form-urlencoded{parameters}"})
    assert answer.status_code == 415 and seen == [], answer.text


@pytest.mark.parametrize("parameters", ["", "; charset=utf-8", ";charset=UTF-8", '; charset="utf-8"'])
def test_a_utf8_form_is_forwarded(seen: list[httpx.Request], parameters: str) -> None:
    with TestClient(published(noting(seen)), base_url=PUBLIC) as client:
        answer = client.post(TOKEN, content=b"grant_type=password&client_id=appliance-cli",
                             headers={"content-type": f"application/x-www-form-urlencoded{parameters}"})
    assert answer.status_code == 200 and len(seen) == 1, answer.text


@pytest.mark.parametrize("query", ["client_id=account-console", "client_id=appliance-cli&client_id=admin-cli",
                                   "client%5Fid=security-admin-console", "client_id="])
@pytest.mark.parametrize("path", ["protocol/openid-connect/token", "protocol/openid-connect/auth/device",
                                  "protocol/openid-connect/revoke"])
def test_a_form_routes_query_names_no_other_client(client: TestClient, seen: list[httpx.Request], path: str,
                                                   query: str) -> None:
    """Keycloak takes the query's client_id where it reads no form's: checked as the form's is."""
    answer = client.post(f"/realms/appliance/{path}?{query}", content=f"grant_type=password&{CLIENT}", headers=FORM)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "client_id", answer.text
    assert seen == []


def test_cookies_in_several_headers_are_forwarded_as_one(seen: list[httpx.Request]) -> None:
    with TestClient(published(noting(seen)), base_url=PUBLIC) as client:
        client.get(f"/realms/appliance/protocol/openid-connect/auth?{CLIENT}",
                   headers=[("cookie", "AUTH_SESSION_ID=a"), ("cookie", "KC_RESTART=b")])
    assert seen[0].headers.get_list("cookie") == ["AUTH_SESSION_ID=a; KC_RESTART=b"]
