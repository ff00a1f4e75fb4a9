"""Users: the realm's users and their roles; add (a generated password is shown once), disable,
grant a role."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable

from appliance.roles import Role
from tui.dialogs import Detail, Field, Form
from tui.panel import Panel, fill, selected_key

ROLES = (Role.USER, Role.TRAINER, Role.AUDITOR, Role.ADMIN)  # the least power first: the form's default


class Users(Panel):
    DEFAULT_CSS = Panel.DEFAULT_CSS + "#users { height: 1fr; }"
    BINDINGS = [Binding("n", "add", "Add"), Binding("x", "disable", "Disable"), Binding("g", "grant", "Grant")]

    def body(self) -> ComposeResult:
        yield DataTable(id="users", cursor_type="row")

    def on_mount(self) -> None:
        super().on_mount()
        self.query_one("#users", DataTable).add_columns("user", "enabled", "roles")

    async def load(self) -> None:
        users = await self.client.call("GET", "/users")
        fill(self.query_one("#users", DataTable),
             [(u["username"], (u["username"], "yes" if u["enabled"] else "DISABLED", ", ".join(u["roles"]) or "-"))
              for u in sorted(users, key=lambda u: u["username"])])

    def action_add(self) -> None:
        def chosen(values: dict[str, str] | None) -> None:
            if values is None:
                return

            async def add() -> None:
                created: Any = await self.client.call("POST", "/users", json={"username": values["username"],
                                                                               "roles": [values["role"]]})
                self.app.push_screen(Detail(f"User {created['username']} created",
                                            f"Password (shown only now): {created['password']}"))

            self.act(add, f"user {values['username']} added")

        self.app.push_screen(Form("Add a user", [Field("username", "username"), Field("role", "role", ROLES)]),
                             chosen)

    def action_disable(self) -> None:
        name = selected_key(self.query_one("#users", DataTable))
        if name is not None:
            self.act(lambda: self.client.call("POST", f"/users/{name}/disable"), f"user {name} disabled",
                     f"Disable user {name!r}? New logins fail and live tokens stop within seconds.")

    def action_grant(self) -> None:
        name = selected_key(self.query_one("#users", DataTable))
        if name is None:
            return

        def chosen(values: dict[str, str] | None) -> None:
            if values is not None:
                self.act(lambda: self.client.call("POST", f"/users/{name}/roles", json={"role": values["role"]}),
                         f"{name} now holds {values['role']}", f"Grant {values['role']!r} to {name!r}?")

        self.app.push_screen(Form(f"Grant a role to {name}", [Field("role", "role", ROLES)]), chosen)
