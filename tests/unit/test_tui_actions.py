"""The TUI's user and adapter actions the CLI has too: enable a user, reset a password (shown
once), unlock a user, retire an adapter version. Each asks first, calls the admin API's own route
once confirmed, and nothing when declined. Against the fake admin API of tests/unit/test_tui.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from textual.pilot import Pilot

from appliance.home import Home
from tests.support.pilot import until
from tests.unit.test_tui import Fake, sample_answers, select, show, shown_text, with_fake

if TYPE_CHECKING:
    from tui.app import AdminApp

PASSWORD = "Xk2-generated-once"


class Posting(Fake):
    """The fake admin API, answering a password reset as the route does."""

    async def call(self, method: str, path: str, **kwargs: Any) -> Any:
        if method == "POST" and path.endswith("/password"):
            self.calls.append((method, path, kwargs.get("json")))
            return {"username": path.split("/")[2], "password": PASSWORD}
        return await super().call(method, path, **kwargs)


def posting(home: Home, scenario: Any) -> Posting:
    """Run `scenario` with a Posting fake in place of the one `with_fake` makes; that fake."""
    fakes: list[Posting] = []

    async def swapped(pilot: Pilot[None], app: AdminApp, fake: Fake) -> None:
        posting_fake = Posting(fake.answers)
        app.client = posting_fake  # type: ignore[assignment]
        fakes.append(posting_fake)
        await scenario(pilot, app, posting_fake)

    with_fake(home, sample_answers(), swapped)
    return fakes[0]


@pytest.mark.parametrize(("screen", "table", "row", "key", "posted", "asked"), [
    ("u", "users", "frank", "E", "/users/frank/enable", "Enable user 'frank'?"),
    ("u", "users", "frank", "l", "/users/frank/unlock", "Unlock user 'frank'?"),
    ("u", "users", "admin", "p", "/users/admin/password", "Reset the password of 'admin'?"),
    ("j", "adapters", "support-bot:3", "r", "/adapters/support-bot/retire", "Retire support-bot v3?"),
], ids=["enable", "unlock", "reset-password", "retire"])
def test_an_action_asks_then_calls_its_route_and_nothing_when_declined(
        home: Home, screen: str, table: str, row: str, key: str, posted: str, asked: str) -> None:
    async def scenario(pilot: Pilot[None], app: AdminApp, fake: Fake) -> None:
        await show(pilot, screen)
        await select(pilot, table, row)
        await pilot.press(key)
        await until(pilot, lambda: type(app.screen).__name__ == "Confirm", "the question")
        assert asked in shown_text(app, "question")
        await pilot.press("n")
        await until(pilot, lambda: type(app.screen).__name__ != "Confirm", "the question gone")
        assert fake.posted() == [], "declined: nothing asked"
        await pilot.press(key)
        await until(pilot, lambda: type(app.screen).__name__ == "Confirm", "the question again")
        await pilot.press("y")
        await until(pilot, lambda: fake.posted() == [posted], f"POST {posted}")

    fake = posting(home, scenario)
    body = [kwargs for method, path, kwargs in fake.calls if method == "POST"]
    if key == "p":
        assert body == [{"password": None}], "a generated password"


def test_a_reset_password_is_shown_once_in_a_detail(home: Home) -> None:
    async def scenario(pilot: Pilot[None], app: AdminApp, fake: Fake) -> None:
        await show(pilot, "u")
        await select(pilot, "users", "admin")
        await pilot.press("p")
        await until(pilot, lambda: type(app.screen).__name__ == "Confirm", "the question")
        await pilot.press("y")
        await until(pilot, lambda: type(app.screen).__name__ == "Detail", "the new password")
        assert f"New password (shown only now): {PASSWORD}" in shown_text(app, "detail-body")

    posting(home, scenario)
