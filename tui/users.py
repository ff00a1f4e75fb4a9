"""Users: the realm's users and their roles; add (a generated password is shown once), disable
an enabled user or enable a disabled one, grant a role the user does not hold yet, revoke one they
hold (never the last enabled administrator's admin), reset a password (a generated one, shown
once), unlock a user locked out by failed logins."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Label

from appliance.roles import Role
from tui.dialogs import Detail, Field, Form
from tui.panel import Panel

ROLES = (Role.USER, Role.TRAINER, Role.AUDITOR, Role.ADMIN)  # the least power first: the form's default


class Users(Panel):
    DEFAULT_CSS = Panel.DEFAULT_CSS + """
    #users { height: 1fr; }
    Label { padding: 0 1; text-style: bold; }
    """
    # Listed in the title (the footer lists the screens).
    BINDINGS = [Binding("n", "add", "add", show=False), Binding("x", "disable", "disable", show=False),
                Binding("E", "enable", "enable", show=False), Binding("g", "grant", "grant", show=False),
                Binding("r", "revoke", "revoke", show=False),
                Binding("p", "reset_password", "new password", show=False),
                Binding("l", "unlock", "unlock", show=False)]
    EMPTY = {"users": "No users in the realm: add one with n (or `appliance users add`)."}

    def __init__(self) -> None:
        super().__init__()
        self.users: dict[str, dict[str, Any]] = {}

    def body(self) -> ComposeResult:
        yield Label("Users", id="users-title")
        yield from self.listing("users")

    def on_mount(self) -> None:
        self.query_one("#users", DataTable).add_columns("user", "enabled", "roles")

    async def load(self) -> None:
        users = await self.client.call("GET", "/users")
        self.users = {u["username"]: u for u in users}
        self.fill("users", [(u["username"], (u["username"], "yes" if u["enabled"] else "DISABLED",
                                             ", ".join(u["roles"]) or "-"))
                            for u in sorted(users, key=lambda u: u["username"])])

    def grantable(self, name: str) -> tuple[str, ...]:
        """The roles `name` does not hold yet."""
        held = set(self.users.get(name, {}).get("roles", ()))
        return tuple(role for role in ROLES if role not in held)

    def revocable(self, name: str) -> tuple[str, ...]:
        """The roles `name` holds, admin only while another enabled user holds it too: the
        appliance never revokes the last enabled administrator's."""
        held = set(self.users.get(name, {}).get("roles", ()))
        other_admin = any(user["enabled"] and Role.ADMIN in user["roles"]
                          for username, user in self.users.items() if username != name)
        return tuple(role for role in ROLES if role in held and (role != Role.ADMIN or other_admin))

    def offers(self, action: str, parameters: tuple[object, ...]) -> bool:
        name = self.selected("users")
        if action == "disable":
            return name is not None and bool(self.users.get(name, {}).get("enabled"))
        if action == "enable":
            return name is not None and self.users.get(name, {}).get("enabled") is False
        if action == "grant":
            return name is not None and bool(self.grantable(name))
        if action == "revoke":
            return name is not None and bool(self.revocable(name))
        if action in ("reset_password", "unlock"):
            return name is not None
        return True

    def show_keys(self) -> None:
        self.query_one("#users-title", Label).update(
            self.titled("Users", ["add", "disable", "enable", "grant", "revoke",
                                    "reset_password", "unlock"]))

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
        name = self.selected("users")
        if name is not None:
            self.act(lambda: self.client.call("POST", f"/users/{name}/disable"), f"user {name} disabled",
                     f"Disable user {name!r}? New logins fail and live tokens stop within seconds.")

    def action_grant(self) -> None:
        self._change_role("Grant a role to {name}", self.grantable, "POST", "/users/{name}/roles",
                          "{name} now holds {role}", "Grant {role!r} to {name!r}?", body=True)

    def action_revoke(self) -> None:
        self._change_role("Revoke a role from {name}", self.revocable, "DELETE", "/users/{name}/roles/{role}",
                          "{name} no longer holds {role}",
                          "Revoke {role!r} from {name!r}? Their API keys lose it within seconds.")

    def _change_role(self, title: str, roles: Callable[[str], tuple[str, ...]], method: str, path: str, done: str,
                     question: str, *, body: bool = False) -> None:
        """Ask which role (of `roles(name)`) for the selected user, then whether, then call the route."""
        name = self.selected("users")
        if name is None:
            return

        def chosen(values: dict[str, str] | None) -> None:
            if values is not None:
                words = {"name": name, "role": values["role"]}
                self.act(lambda: self.client.call(method, path.format(**words),
                                                  json={"role": words["role"]} if body else None),
                         done.format(**words), question.format(**words))

        self.app.push_screen(Form(title.format(name=name), [Field("role", "role", roles(name))]), chosen)

    def action_enable(self) -> None:
        name = self.selected("users")
        if name is not None:
            self.act(lambda: self.client.call("POST", f"/users/{name}/enable"), f"user {name} enabled",
                     f"Enable user {name!r}? They can log in again.")

    def action_reset_password(self) -> None:
        name = self.selected("users")
        if name is None:
            return

        async def reset() -> None:
            answer: Any = await self.client.call("POST", f"/users/{name}/password", json={"password": None})
            self.app.push_screen(Detail(f"Password of {answer['username']} reset",
                                        f"New password (shown only now): {answer['password']}"))

        self.act(reset, f"password of {name} reset",
                 f"Reset the password of {name!r}? A new one is generated and shown once; the old one stops working.")

    def action_unlock(self) -> None:
        name = self.selected("users")
        if name is not None:
            self.act(lambda: self.client.call("POST", f"/users/{name}/unlock"), f"user {name} unlocked",
                     f"Unlock user {name!r}? Their failed logins are cleared and they can log in again.")
