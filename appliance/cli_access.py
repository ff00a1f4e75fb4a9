"""`appliance token` and `appliance users ...`: log in, and manage users through the admin API."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.table import Table

from appliance import login
from appliance.errors import ApplianceError
from appliance.home import Home
from appliance.settings import Settings, load_settings

users_app = typer.Typer(help="Users and roles of the realm (through the gateway's admin API).",
                        no_args_is_help=True)
out = Console()


def _context() -> tuple[Settings, Home]:
    home = Home.from_env().ensure()
    return load_settings(home.settings_file), home


def _read_password() -> str:
    password = sys.stdin.readline().rstrip("\n")
    if not password:
        raise ApplianceError("--password-stdin: no password on standard input")
    return password


def token(
    user: Annotated[str | None, typer.Option("--user", help="Log in as this user (with --password-stdin).")] = None,
    password_stdin: Annotated[bool, typer.Option("--password-stdin", help="Read the password from stdin.")] = False,
    print_token: Annotated[bool, typer.Option("--print", help="Print the access token to stdout.")] = False,
) -> None:
    """Log in (device code by default; a password for scripts), cache the token 0600, refresh it."""
    settings, home = _context()
    if user and password_stdin:
        cached = login.password_login(settings, home, user, _read_password())
    elif user or password_stdin:
        raise ApplianceError("--user and --password-stdin go together")
    elif print_token:
        cached = login.current_token(settings, home)
    else:
        cached = login.device_login(settings, home, lambda url, code: typer.echo(
            f"Open {url} and enter the code {code} to approve this login.", err=True))
    if print_token:
        typer.echo(cached.access_token)
    else:
        out.print(f"logged in as {cached.username}; token cached in {home.secrets / login.CACHE}")


def _admin_api(method: str, path: str, **kwargs: Any) -> Any:
    settings, home = _context()
    cached = login.current_token(settings, home)
    url = f"http://127.0.0.1:{settings.gateway.port}/admin{path}"
    try:
        response = httpx.request(method, url, headers={"Authorization": f"Bearer {cached.access_token}"},
                                 timeout=60, **kwargs)
    except httpx.HTTPError as exc:
        raise ApplianceError(f"the gateway at {url} is not reachable: {exc}",
                             hint="is the appliance up? (`appliance status`)") from exc
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:300]
        raise ApplianceError(f"{method} /admin{path}: {response.status_code} {message}")
    return response.json()


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
        body["password"] = _read_password()
    created = _admin_api("POST", "/users", json=body)
    out.print(f"user {created['username']} created with roles {', '.join(created['roles'])}")
    if created.get("password"):
        out.print(f"generated password (shown once): {created['password']}", highlight=False)


@users_app.command("list")
def users_list() -> None:
    """Users and their roles."""
    table = Table("user", "enabled", "roles")
    for user in _admin_api("GET", "/users"):
        table.add_row(user["username"], "yes" if user["enabled"] else "no", ", ".join(user["roles"]))
    out.print(table)


@users_app.command("roles")
def users_roles() -> None:
    """The roles the appliance knows."""
    for role in _admin_api("GET", "/roles"):
        out.print(role)


@users_app.command("disable")
def users_disable(name: Annotated[str, typer.Argument(help="Username.")]) -> None:
    """Disable a user; their tokens stop working within the introspection interval."""
    user = _admin_api("POST", f"/users/{name}/disable")
    out.print(f"user {user['username']} disabled")


def register(app: typer.Typer) -> None:
    app.command("token")(token)
    app.add_typer(users_app, name="users")
