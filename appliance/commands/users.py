"""`appliance users ...`: the realm's users and roles, through the gateway's admin API (or, to
unlock an administrator locked out, through this host's state directory)."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import Console

from appliance.changes import note_target, records_change
from appliance.commands.common import AsJson, admin_api, context, old_spelling, print_json, read_password
from appliance.roles import Role
from appliance.terminal import Listing, text

users_app = typer.Typer(help="Users and roles of the realm (through the gateway's admin API).",
                        no_args_is_help=True)
out = Console()

Name = Annotated[str, typer.Argument(help="Username.")]
PasswordStdin = Annotated[bool, typer.Option("--password-stdin", help="Read the password from stdin (otherwise one "
                                             "is generated and shown once).")]


@users_app.command("add")
def users_add(
    name: Name,
    role: Annotated[list[Role], typer.Option("--role", help="admin, user, trainer or auditor; repeatable.")],
    password_stdin: PasswordStdin = False,
) -> None:
    """Create a user with roles."""
    body: dict[str, Any] = {"username": name, "roles": role}
    if password_stdin:
        body["password"] = read_password()
    created = admin_api("POST", "/users", json=body)
    out.print(f"user {created['username']} created with roles {', '.join(created['roles'])}", markup=False)
    _show_generated(created)


@users_app.command("list")
def users_list(as_json: AsJson = False) -> None:
    """Users and their roles."""
    users = admin_api("GET", "/users")
    if as_json:
        print_json(users)
        return
    table = Listing("user", "enabled", text("roles"))
    for user in users:
        table.add_row(user["username"], "yes" if user["enabled"] else "no", ", ".join(user["roles"]))
    out.print(table, crop=False)


@users_app.command("list-roles")
def users_list_roles(as_json: AsJson = False) -> None:
    """The roles the appliance knows, one a line."""
    roles = admin_api("GET", "/roles")
    if as_json:
        print_json(roles)
        return
    for role in roles:
        out.print(role, markup=False, highlight=False)


@users_app.command("disable")
def users_disable(name: Name) -> None:
    """Disable a user; their tokens stop working within the introspection interval."""
    user = admin_api("POST", f"/users/{name}/disable")
    out.print(f"user {user['username']} disabled", markup=False)


@users_app.command("enable")
def users_enable(name: Name) -> None:
    """Let a disabled user log in again."""
    user = admin_api("POST", f"/users/{name}/enable")
    out.print(f"user {user['username']} enabled", markup=False)


@users_app.command("grant")
def users_grant(name: Name, role: Annotated[Role, typer.Argument(help="admin, user, trainer or auditor.")]) -> None:
    """Grant a user one more role (granting one they hold changes nothing)."""
    user = admin_api("POST", f"/users/{name}/roles", json={"role": role})
    out.print(f"user {user['username']} now holds {', '.join(user['roles'])}", markup=False)


@users_app.command("revoke")
def users_revoke(name: Name, role: Annotated[Role, typer.Argument(help="admin, user, trainer or auditor.")]) -> None:
    """Revoke a role from a user; the last enabled administrator keeps admin."""
    user = admin_api("DELETE", f"/users/{name}/roles/{role}")
    out.print(f"user {user['username']} now holds {', '.join(user['roles']) or 'no role'}", markup=False)


@users_app.command("reset-password")
def users_reset_password(name: Name, password_stdin: PasswordStdin = False) -> None:
    """Set a new password for a user: generated and shown once, or read from standard input
    (never from the command line, where other users and the shell's history see it)."""
    body = {"password": read_password() if password_stdin else None}
    reset = admin_api("POST", f"/users/{name}/password", json=body)
    out.print(f"password of {reset['username']} reset", markup=False)
    _show_generated(reset)


@users_app.command("unlock")
def users_unlock(
    name: Name,
    on_host: Annotated[bool, typer.Option("--on-host", help="Use this host's state directory instead of the admin "
                                          "API: the way back in for an administrator locked out themselves.")] = False,
) -> None:
    """Clear a user's failed logins and lockout (Keycloak's brute-force detection locks per account)."""
    if on_host:
        user = _unlock_on_host(name)
    else:
        user = admin_api("POST", f"/users/{name}/unlock")
    out.print(f"user {user['username']} unlocked", markup=False)


old_spelling(users_app, "users roles", "users list-roles", users_list_roles)


def _show_generated(answer: dict[str, Any]) -> None:
    if answer.get("password"):
        out.print(f"generated password (shown once): {answer['password']}", highlight=False, markup=False)


@records_change("users.unlock", detail=lambda: "unlocked on the host")
def _unlock_on_host(name: str) -> dict[str, Any]:
    """Through the gateway's service account, whose secret only this host's administrator reads."""
    from appliance.users import Users  # python-keycloak: only for this command, not every CLI start

    note_target("user", name)
    settings, home = context()
    return Users(settings, home).unlock(name).model_dump()
