"""`appliance users ...`: the realm's users and roles, through the gateway's admin API (or, to
unlock an administrator locked out, through this host's state directory)."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from appliance.changes import records_change
from appliance.commands.common import admin_api, context, read_password

users_app = typer.Typer(help="Users and roles of the realm (through the gateway's admin API).",
                        no_args_is_help=True)
out = Console()


@users_app.command("add")
def users_add(
    name: Annotated[str, typer.Argument(help="Username.")],
    role: Annotated[list[str], typer.Option("--role", help="admin, user, trainer or auditor; repeatable.")],
    password_stdin: Annotated[bool, typer.Option("--password-stdin", help="Read the password from stdin "
                                                 "(otherwise one is generated and shown once).")] = False,
) -> None:
    """Create a user with roles."""
    body: dict[str, Any] = {"username": name, "roles": role}
    if password_stdin:
        body["password"] = read_password()
    created = admin_api("POST", "/users", json=body)
    out.print(f"user {created['username']} created with roles {', '.join(created['roles'])}")
    if created.get("password"):
        out.print(f"generated password (shown once): {created['password']}", highlight=False)


@users_app.command("list")
def users_list() -> None:
    """Users and their roles."""
    table = Table("user", "enabled", "roles")
    for user in admin_api("GET", "/users"):
        table.add_row(user["username"], "yes" if user["enabled"] else "no", ", ".join(user["roles"]))
    out.print(table)


@users_app.command("roles")
def users_roles() -> None:
    """The roles the appliance knows."""
    for role in admin_api("GET", "/roles"):
        out.print(role)


@users_app.command("disable")
def users_disable(name: Annotated[str, typer.Argument(help="Username.")]) -> None:
    """Disable a user; their tokens stop working within the introspection interval."""
    user = admin_api("POST", f"/users/{name}/disable")
    out.print(f"user {user['username']} disabled")


@users_app.command("unlock")
def users_unlock(
    name: Annotated[str, typer.Argument(help="Username.")],
    on_host: Annotated[bool, typer.Option("--on-host", help="Use this host's state directory instead of the admin "
                                          "API: the way back in for an administrator locked out themselves.")] = False,
) -> None:
    """Clear a user's failed logins and lockout (Keycloak's brute-force detection locks per account)."""
    if on_host:
        user = _unlock_on_host(name)
    else:
        user = admin_api("POST", f"/users/{name}/unlock")
    out.print(f"user {user['username']} unlocked", markup=False)


@records_change("users.unlock", detail=lambda: f"user {_unlocked[-1]} unlocked on the host")
def _unlock_on_host(name: str) -> dict[str, Any]:
    """Through the gateway's service account, whose secret only this host's administrator reads."""
    from appliance.users import Users  # python-keycloak: only for this command, not every CLI start

    settings, home = context()
    user = Users(settings, home).unlock(name)
    _unlocked.append(user.username)
    return user.model_dump()


_unlocked: list[str] = []  # for the change's record
