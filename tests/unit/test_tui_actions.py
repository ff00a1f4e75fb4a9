"""The TUI's user, adapter and key actions the CLI has too: enable a user, reset a password (shown
once), unlock a user, revoke a role, retire an adapter version, change a key's limits. Each asks
first, calls the admin API's own route once confirmed, and nothing when declined; the keys screen
shows a key's own limits. Against the fake admin API of tests/unit/test_tui.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from textual.pilot import Pilot
from textual.widgets import Input, Select

from appliance.home import Home
from tests.support.pilot import until
from tests.unit.test_tui import (
    Fake,
    api_key,
    sample_answers,
    screen_lines,
    select,
    show,
    shown_text,
    user,
    with_fake,
)

if TYPE_CHECKING:
    from tui.app import AdminApp

PASSWORD = "Xk2-generated-once"


class Posting(Fake):
    """The fake admin API, answering a password reset and a role revoked as the routes do."""

    async def call(self, method: str, path: str, **kwargs: Any) -> Any:
        if method == "POST" and path.endswith("/password"):
            self.calls.append((method, path, kwargs.get("json")))
            return {"username": path.split("/")[2], "password": PASSWORD}
        if method == "DELETE":
            self.calls.append((method, path, None))
            return user(path.split("/")[2])
        if method == "PATCH":
            self.calls.append((method, path, {"params": kwargs.get("params"), "json": kwargs.get("json")}))
            return {}
        return await super().call(method, path, **kwargs)

    def deleted(self) -> list[str]:
        return [path for method, path, _ in self.calls if method == "DELETE"]

    def patched(self) -> list[tuple[str, Any]]:
        return [(path, sent) for method, path, sent in self.calls if method == "PATCH"]


def posting(home: Home, scenario: Any, answers: dict[str, Any] | None = None) -> Posting:
    """Run `scenario` with a Posting fake in place of the one `with_fake` makes; that fake."""
    fakes: list[Posting] = []

    async def swapped(pilot: Pilot[None], app: AdminApp, fake: Fake) -> None:
        posting_fake = Posting(fake.answers)
        app.client = posting_fake  # type: ignore[assignment]
        fakes.append(posting_fake)
        await scenario(pilot, app, posting_fake)

    with_fake(home, answers or sample_answers(), swapped)
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


async def roles_offered(pilot: Pilot[None], name: str) -> list[str]:
    """The roles the revoke form offers for user `name` (the form closed again); none if not offered."""
    await select(pilot, "users", name)
    await pilot.press("r")
    await pilot.pause(0.2)
    if type(pilot.app.screen).__name__ != "Form":
        return []
    choices = [str(option[0]) for option in pilot.app.screen.query_one("#field-role", Select)._options]
    await pilot.press("escape")
    await until(pilot, lambda: type(pilot.app.screen).__name__ == "Users", "the form gone")
    return choices


def test_revoking_a_role_asks_which_and_whether_then_deletes_it_and_nothing_when_declined(home: Home) -> None:
    async def scenario(pilot: Pilot[None], app: AdminApp, fake: Posting) -> None:
        await show(pilot, "u")
        assert await roles_offered(pilot, "root") == ["user", "trainer", "auditor", "admin"], "the roles root holds"
        for answer in ("n", "y"):
            await pilot.press("r")
            await until(pilot, lambda: type(app.screen).__name__ == "Form", "the roles")
            app.screen.query_one("#field-role", Select).value = "trainer"
            await pilot.click("#ok")
            await until(pilot, lambda: type(app.screen).__name__ == "Confirm", "the question")
            assert "Revoke 'trainer' from 'root'?" in shown_text(app, "question")
            await pilot.press(answer)
            await until(pilot, lambda: type(app.screen).__name__ == "Users", "the question gone")
            if answer == "n":
                await pilot.pause(0.2)
                assert fake.deleted() == [], "declined: nothing asked"
        await until(pilot, lambda: fake.deleted() == ["/users/root/roles/trainer"], "DELETE of the role")
        assert fake.posted() == []

    posting(home, scenario)


def test_revoking_is_not_offered_without_a_role_nor_the_last_enabled_administrator_s_admin(home: Home) -> None:
    answers = {**sample_answers(), "/users": [user("solo", roles=("user", "admin")), user("gone", enabled=False,
                                                                                       roles=("admin",)),
                                              user("nobody", roles=())]}

    async def scenario(pilot: Pilot[None], app: AdminApp, fake: Posting) -> None:
        await show(pilot, "u")
        assert await roles_offered(pilot, "solo") == ["user"], "a disabled administrator does not count"
        assert await roles_offered(pilot, "gone") == ["admin"], "solo is another enabled administrator"
        assert await roles_offered(pilot, "nobody") == []
        assert "r: revoke" not in shown_text(app, "users-title")
        assert type(app.screen).__name__ == "Users" and fake.deleted() == []

    posting(home, scenario, answers)


def test_the_keys_screen_shows_the_selected_key_s_own_limits_at_80x24(home: Home) -> None:
    models = [f"SmolLM2-135M-Instruct-{n}" for n in range(4)]
    limited = {**api_key("etl-bot", "active"), "models": models, "tokens_per_minute": 20000}
    answers = {**sample_answers(), "/keys": [api_key("ci-bot", "active"), limited]}

    async def scenario(pilot: Pilot[None], app: AdminApp, fake: Fake) -> None:
        await show(pilot, "k")
        await select(pilot, "keys", "alice/ci-bot")
        assert shown_text(app, "key-limits") == ("ci-bot of alice: any model alice may use; "
                                                 "alice's token budget only")
        await select(pilot, "keys", "alice/etl-bot")
        assert shown_text(app, "key-limits") == (f"etl-bot of alice: models {', '.join(models)}; "
                                                 "20000 tokens/min of its own, within alice's")
        lines = screen_lines(app)
        assert len(lines) == 24 and all(len(line) <= 80 for line in lines)
        shown = " ".join(" ".join(lines).split())
        assert all(model in shown for model in models) and "20000 tokens/min" in shown, "the limits whole"
        assert any("API keys (n: create, l: limits, x: revoke)" in line for line in lines)

    with_fake(home, answers, scenario)


async def limits_form(pilot: Pilot[None], row: str) -> dict[str, str]:
    """Open the limits form of key `row`; the values it is filled in with."""
    await select(pilot, "keys", row)
    await pilot.press("l")
    await until(pilot, lambda: type(pilot.app.screen).__name__ == "Form", "the limits form")
    return {field: pilot.app.screen.query_one(f"#field-{field}", Input).value for field in ("models", "tokens")}


async def fill_in(pilot: Pilot[None], models: str, tokens: str) -> None:
    pilot.app.screen.query_one("#field-models", Input).value = models
    pilot.app.screen.query_one("#field-tokens", Input).value = tokens
    await pilot.click("#ok")
    await until(pilot, lambda: type(pilot.app.screen).__name__ == "Confirm", "the question")


def test_changing_a_keys_limits_asks_for_them_and_whether_then_patches_it_at_80x24(home: Home) -> None:
    limited = {**api_key("etl-bot", "active"), "models": ["main", "coder"], "tokens_per_minute": 20000}
    answers = {**sample_answers(), "/keys": [api_key("ci-bot", "active"), limited, api_key("old-bot", "revoked")]}

    async def scenario(pilot: Pilot[None], app: AdminApp, fake: Posting) -> None:
        await show(pilot, "k")
        await select(pilot, "keys", "alice/ci-bot")
        assert "API keys (n: create, l: limits, x: revoke)" in shown_text(app, "keys-title")
        assert await limits_form(pilot, "alice/ci-bot") == {"models": "all", "tokens": "none"}, "its limits now"
        lines = screen_lines(app)
        assert len(lines) == 24 and all(len(line) <= 80 for line in lines), "the form fits"
        await fill_in(pilot, "main, coder", "2000")
        assert ("From its next request: models main, coder; 2000 tokens/min of its own, within alice's"
                in " ".join(shown_text(app, "question").split()))
        await pilot.press("n")
        await until(pilot, lambda: type(app.screen).__name__ == "Keys", "the question gone")
        await pilot.pause(0.2)
        assert fake.patched() == [], "declined: nothing asked"
        await limits_form(pilot, "alice/ci-bot")
        await fill_in(pilot, "main, coder", "2000")
        await pilot.press("y")
        await until(pilot, lambda: len(fake.patched()) == 1, "PATCH of the limits")
        assert fake.patched() == [("/keys/ci-bot", {"params": {"owner": "alice"},
                                                    "json": {"models": ["main", "coder"], "tokens_per_minute": 2000}})]
        assert await limits_form(pilot, "alice/etl-bot") == {"models": "main, coder", "tokens": "20000"}
        await fill_in(pilot, "all", "none")
        await pilot.press("y")
        await until(pilot, lambda: len(fake.patched()) == 2, "PATCH clearing the limits")
        assert fake.patched()[1][1]["json"] == {"models": None, "tokens_per_minute": None}, "both cleared"
        await select(pilot, "keys", "alice/old-bot")
        assert "l: limits" not in shown_text(app, "keys-title"), "a revoked key's limits no longer change"
        await pilot.press("l")
        await pilot.pause(0.2)
        assert type(app.screen).__name__ == "Keys" and len(fake.patched()) == 2

    posting(home, scenario, answers)
