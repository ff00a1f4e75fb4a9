"""`appliance token`: log in and cache the token."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from appliance import login
from appliance.commands.common import context, read_password
from appliance.errors import ApplianceError
from appliance.tls import ca_file

out = Console()


def token(
    user: Annotated[str | None, typer.Option("--user", help="Log in as this user (with --password-stdin).")] = None,
    password_stdin: Annotated[bool, typer.Option("--password-stdin", help="Read the password from stdin.")] = False,
    print_token: Annotated[bool, typer.Option("--print", help="Print the access token to stdout.")] = False,
) -> None:
    """Log in (device code by default; a password for scripts), cache the token 0600, refresh it."""
    settings, home = context()
    if user and password_stdin:
        cached = login.password_login(settings, home, user, read_password())
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
