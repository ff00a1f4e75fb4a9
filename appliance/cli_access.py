"""`appliance token`, `appliance users ...` and `appliance adapters ...`: log in, and manage users
and served adapters through the gateway's admin API."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from appliance import login
from appliance.adapters import AdapterRecord, Alias, Registry
from appliance.admin_client import AdminClient
from appliance.changes import records_change
from appliance.errors import ApplianceError
from appliance.home import Home
from appliance.settings import Settings, load_settings
from appliance.tls import ca_file

users_app = typer.Typer(help="Users and roles of the realm (through the gateway's admin API).",
                        no_args_is_help=True)
adapters_app = typer.Typer(help="LoRA adapters: list, deploy into the running engine, canary, roll back, retire "
                           "(through the gateway's admin API).", no_args_is_help=True)
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
        trust = "" if settings.keycloak.mode == "external" else (
            f" (the page's certificate is from the appliance's own CA, {ca_file(home)}: trust it in the browser)")
        cached = login.device_login(settings, home, lambda url, code: typer.echo(
            f"Open {url} and enter the code {code} to approve this login.{trust}", err=True))
    if print_token:
        typer.echo(cached.access_token)
    else:
        out.print(f"logged in as {cached.username}; token cached in {home.secrets / login.CACHE}")


def admin_api(method: str, path: str, **kwargs: Any) -> Any:
    settings, home = _context()
    return AdminClient(settings, home).call_sync(method, path, **kwargs)


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

    settings, home = _context()
    user = Users(settings, home).unlock(name)
    _unlocked.append(user.username)
    return user.model_dump()


_unlocked: list[str] = []  # for the change's record


@adapters_app.command("list")
def adapters_list() -> None:
    """Adapter versions with their held-out loss, state, and what each name serves."""
    registry = Registry.model_validate(admin_api("GET", "/adapters"))
    table = Table("adapter", "version", "state", "base", "held-out loss (base -> adapter)", "dataset")
    for record in registry.adapters:
        loss = f"{record.metrics.base_eval_loss:.4f} -> {record.metrics.adapter_eval_loss:.4f}"
        table.add_row(record.name, str(record.version), record.state, record.base_model, loss, record.dataset)
    out.print(table)
    for name, alias in sorted(registry.aliases.items()):
        serves = f"v{alias.stable}" if alias.stable is not None else "the base model"
        if alias.canary is not None:
            serves += f", canary v{alias.canary} ({alias.canary_share:.0%})"
        out.print(f"{name}: {serves} on pool {alias.pool}, for roles {', '.join(alias.roles)}")


@adapters_app.command("deploy")
def adapters_deploy(
    name: Annotated[str, typer.Argument(help="Adapter name.")],
    version: Annotated[int | None, typer.Option(min=1, help="Default: the newest that passed its gate.")] = None,
    pool: Annotated[str | None, typer.Option(help="Engine pool (default: as before, else the first).")] = None,
    role: Annotated[list[str] | None, typer.Option("--role", help="Role allowed to call it; repeatable "
                                                   "(default: as before, else user and admin).")] = None,
) -> None:
    """Hot-load a version into the running engine and serve it under its name."""
    alias = Alias.model_validate(admin_api("POST", f"/adapters/{name}/deploy",
                                           json={"version": version, "pool": pool, "roles": role}))
    out.print(f"{name} serves v{alias.stable} on pool {alias.pool}")


@adapters_app.command("canary")
def adapters_canary(
    name: Annotated[str, typer.Argument(help="Adapter name.")],
    version: Annotated[int, typer.Option(min=1, help="The version to try.")],
    share: Annotated[float, typer.Option(min=0, max=1, help="Fraction of requests it gets, e.g. 0.1.")],
) -> None:
    """Send a share of the name's requests to another version."""
    answer = admin_api("POST", f"/adapters/{name}/canary", json={"version": version, "share": share})
    alias = Alias.model_validate(answer)
    out.print(f"{name}: v{alias.canary} gets {alias.canary_share:.0%} of requests, v{alias.stable} the rest")


@adapters_app.command("rollback")
def adapters_rollback(name: Annotated[str, typer.Argument(help="Adapter name.")]) -> None:
    """Drop the canary; without one, serve the version served before (or the base model)."""
    alias = Alias.model_validate(admin_api("POST", f"/adapters/{name}/rollback"))
    out.print(f"{name} serves {'v' + str(alias.stable) if alias.stable is not None else 'the base model'}")


@adapters_app.command("retire")
def adapters_retire(
    name: Annotated[str, typer.Argument(help="Adapter name.")],
    version: Annotated[int | None, typer.Option(min=1, help="Default: every version, and the name.")] = None,
) -> None:
    """Retire a version that is not served, or the whole name."""
    retired = [AdapterRecord.model_validate(r) for r in admin_api("POST", f"/adapters/{name}/retire",
                                                                   json={"version": version})]
    out.print("retired " + ", ".join(f"{r.name} v{r.version}" for r in retired))


def register(app: typer.Typer) -> None:
    app.command("token")(token)
    app.add_typer(users_app, name="users")
    app.add_typer(adapters_app, name="adapters")
