"""The TUI keeps the login it started with: it holds its own session (taken from the CLI's cached
login at start, refreshed in memory), so `appliance token` for another user while it runs changes
neither whose requests it sends nor the user its title names; a session that can no longer be
refreshed says that its login ended and how to log in again."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import httpx
import pytest
from textual.pilot import Pilot

from appliance import login
from appliance.admin_client import AdminClient, NotLoggedIn, Unreachable
from appliance.home import Home
from appliance.settings import Settings
from tests.support.pilot import until
from tests.support.tokens import admin_token, here
from tests.unit.test_tui import EMPTY_ANSWERS, shown_text

AGAIN = "press L to log in again"


class Gateway:
    """The admin API behind a MockTransport: answers every read as a fresh install does and
    records whose token each request carried."""

    def __init__(self, tokens: dict[str, str]) -> None:
        self.tokens = tokens  # access token -> its user
        self.senders: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.senders.append(self.tokens[request.headers["authorization"].removeprefix("Bearer ")])
        if request.url.path == "/metrics":
            return httpx.Response(200, text="")
        return httpx.Response(200, json=EMPTY_ANSWERS[request.url.path.removeprefix("/admin")])


def session_client(home: Home, gateway: Gateway) -> tuple[login.Session, AdminClient]:
    session = login.Session(here(home), again=AGAIN)
    client = AdminClient(session.connection, session=session)
    client._http = httpx.AsyncClient(base_url=client.base_url, transport=httpx.MockTransport(gateway))
    return session, client


def refreshing(monkeypatch: pytest.MonkeyPatch, answer: httpx.Response) -> list[dict[str, str]]:
    """Keycloak's token endpoint answering every refresh with `answer`; the refreshes asked."""
    asked: list[dict[str, str]] = []

    def post(_connection: object, name: str, data: dict[str, str]) -> httpx.Response:
        asked.append(data)
        return answer
    monkeypatch.setattr(login, "_post", post)
    return asked


def test_a_session_keeps_its_first_user_when_the_cached_login_is_replaced(home: Home,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    admin, mallory = admin_token("admin"), admin_token("mallory", roles=("user",))
    gateway = Gateway({admin.access_token: "admin", mallory.access_token: "mallory"})
    login.save(here(home), admin)
    session, client = session_client(home, gateway)

    async def calls() -> None:
        await client.call("GET", "/users")
        login.save(here(home), mallory)  # `appliance token --user mallory` at the CLI
        await client.call("GET", "/users")
        await client.metrics_text()
        assert await client.username() == "admin"

    asyncio.run(calls())
    assert gateway.senders == ["admin"] * 3
    assert login.cached_login(here(home)).username == "mallory", "the CLI's login is its own"

    # Near its expiry the session refreshes itself, in memory: the cache keeps the CLI's login.
    session.adopt(dataclasses.replace(admin, expires_at=time.time() + 1))
    fresh = admin_token("admin")
    gateway.tokens[fresh.access_token] = "admin"
    asked = refreshing(monkeypatch, httpx.Response(200, json={
        "access_token": fresh.access_token, "refresh_token": "r2", "expires_in": 300, "refresh_expires_in": 1800}))
    asyncio.run(client.call("GET", "/users"))
    assert [a["refresh_token"] for a in asked] == ["refresh"]
    assert gateway.senders[-1] == "admin" and session.token().refresh_token == "r2"
    assert login.cached_login(here(home)).username == "mallory"


@pytest.mark.parametrize(("held", "answer", "says"), [
    ({"refresh_expires_at": 0.0}, None, "the login as admin has expired"),
    ({}, httpx.Response(400, json={"error": "invalid_grant", "error_description": "Session not active"}),
     "the login as admin has ended: Keycloak refused the login: Session not active"),
])
def test_a_session_that_cannot_be_refreshed_says_its_login_ended_and_how_to_log_in_again(
        home: Home, monkeypatch: pytest.MonkeyPatch, held: dict[str, float], answer: httpx.Response | None,
        says: str) -> None:
    gateway = Gateway({})
    session, client = session_client(home, gateway)
    session.adopt(dataclasses.replace(admin_token("admin"), expires_at=time.time() - 1, **held))
    login.save(here(home), admin_token("mallory"))  # a valid login in the cache is not taken instead
    if answer is not None:
        refreshing(monkeypatch, answer)
    with pytest.raises(NotLoggedIn) as ended:
        asyncio.run(client.call("GET", "/users"))
    assert ended.value.message == f"{says}; {AGAIN}"
    assert gateway.senders == []


def test_a_session_keeps_its_login_while_keycloak_does_not_answer(home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    session, client = session_client(home, Gateway({}))
    held = dataclasses.replace(admin_token("admin"), expires_at=time.time() - 1)
    session.adopt(held)

    def post(connection: Any, name: str, data: dict[str, str]) -> httpx.Response:
        raise login.KeycloakUnreachable("Keycloak at https://kc is not reachable: refused")
    monkeypatch.setattr(login, "_post", post)
    with pytest.raises(Unreachable, match="not reachable"):
        asyncio.run(client.call("GET", "/users"))
    monkeypatch.setattr(login, "_post", lambda *args: httpx.Response(200, json={
        "access_token": held.access_token, "refresh_token": "r2", "expires_in": 300, "refresh_expires_in": 1800}))
    assert session.token().username == "admin"


def test_a_session_without_a_cached_login_says_how_to_log_in(home: Home) -> None:
    here(home).token_cache.unlink(missing_ok=True)
    _, client = session_client(home, Gateway({}))
    with pytest.raises(NotLoggedIn, match=f"not logged in; {AGAIN}"):
        asyncio.run(client.call("GET", "/users"))


def test_the_tui_keeps_its_user_and_title_when_the_cli_logs_in_as_another(home: Home,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from tui.app import AdminApp

    admin, mallory = admin_token("admin"), admin_token("mallory", roles=("user",))
    gateway = Gateway({admin.access_token: "admin", mallory.access_token: "mallory"})
    login.save(here(home), admin)
    app = AdminApp(Settings(), home)
    assert app.client.session is app.session
    app.client._http = httpx.AsyncClient(base_url=app.client.base_url, transport=httpx.MockTransport(gateway))

    async def scenario(pilot: Pilot[None]) -> None:
        await until(pilot, lambda: app.sub_title.startswith("admin @"), "the title naming the user")
        login.save(here(home), mallory)
        for key in "ud":
            sent = len(gateway.senders)
            await pilot.press(key)
            await until(pilot, lambda sent=sent: len(gateway.senders) > sent, "the screen's reload")
        assert set(gateway.senders) == {"admin"}
        assert app.sub_title.startswith("admin @")

        # Its own session ends (revoked in Keycloak, say): the banner says so and what to do.
        app.session.adopt(dataclasses.replace(admin, expires_at=time.time() - 1))
        refreshing(monkeypatch, httpx.Response(400, json={"error": "invalid_grant",
                                                          "error_description": "Session not active"}))
        await pilot.press("u")
        await until(pilot, lambda: "ended" in shown_text(app, "banner"), "the ended-login banner")
        assert shown_text(app, "banner") == ("Not logged in: the login as admin has ended: Keycloak refused the "
                                             f"login: Session not active; {AGAIN}")

    async def run() -> None:
        async with app.run_test(size=(80, 24)) as pilot:
            await scenario(pilot)

    asyncio.run(run())


def test_a_login_made_in_the_tui_is_the_one_it_holds_from_then_on(home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    """L (the device login) replaces the TUI's session, and its title names the new user."""
    from tui.app import AdminApp

    admin, bob = admin_token("admin"), admin_token("bob")
    gateway = Gateway({admin.access_token: "admin", bob.access_token: "bob"})
    login.save(here(home), admin)
    monkeypatch.setattr(login, "device_login", lambda connection, show: bob)
    app = AdminApp(Settings(), home)
    app.client._http = httpx.AsyncClient(base_url=app.client.base_url, transport=httpx.MockTransport(gateway))

    async def run() -> None:
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.sub_title.startswith("admin @"), "the title naming admin")
            await pilot.press("L")
            await until(pilot, lambda: app.sub_title.startswith("bob @"), "the title naming bob")
            sent = len(gateway.senders)
            await pilot.press("u")
            await until(pilot, lambda: len(gateway.senders) > sent, "the users screen's reload")
            assert gateway.senders[-1] == "bob"

    asyncio.run(run())
