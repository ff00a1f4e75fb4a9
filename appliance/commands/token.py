"""`appliance token`: log in and cache the token; `appliance whoami`: who the cached login is."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from appliance import connection as connections
from appliance import login
from appliance.commands.common import connection, read_password
from appliance.errors import ApplianceError
from appliance.terminal import duration, shown

out = Console()


def token(
    user: Annotated[str | None, typer.Option("--user", help="Log in as this user (with --password-stdin).")] = None,
    password_stdin: Annotated[bool, typer.Option("--password-stdin", help="Read the password from stdin.")] = False,
    print_token: Annotated[bool, typer.Option(
        "--print", help="Print the access token to stdout. With --user, print that user's token and leave the "
        "cached login as it is (unless --save).")] = False,
    save: Annotated[bool, typer.Option(
        "--save", help="With --user and --print: also cache that user's token, replacing the cached login.")
    ] = False,
    gateway: Annotated[str | None, typer.Option(
        "--gateway", help="Log in to the appliance whose gateway is at https://HOST[:PORT] (from a workstation, or "
        "a non-root account) and make it this user's current appliance; `local`: this host's again.")] = None,
    ca_file: Annotated[Path | None, typer.Option(
        "--ca-file", help="With --gateway: the CA certificate that verifies the gateway (`appliance tls export-ca` "
        "prints it); unset: the system's trust store.")] = None,
) -> None:
    """Log in (device code by default; a password for scripts), cache the token 0600, refresh it.

    `--print` alone prints the cached login's token (refreshed if need be). `--user NAME
    --password-stdin --print` prints a token of NAME without touching the cached login, so a token
    for another user never silently replaces the administrator's; add `--save` to cache it.
    """
    if save and not (user and print_token):
        raise ApplianceError("--save goes with --user and --print: a login without --print is always cached")
    if (user is None) != (not password_stdin):
        raise ApplianceError("--user and --password-stdin go together")
    if ca_file is not None and gateway in (None, "local"):
        raise ApplianceError("--ca-file goes with --gateway https://HOST[:PORT]")
    if gateway == "local":
        connections.forget()
        target = connection()
    elif gateway is not None:
        target = connections.discover(gateway, ca_file)  # made current only once logged in
    else:
        target = connection()
    if user:
        cached = login.password_login(target, user, read_password(), cache=save or not print_token)
    elif print_token:
        cached = login.current_token(target)
    else:
        cached = login.device_login(target, lambda url, code: typer.echo(
            f"Open {url} and enter the code {code} to approve this login.", err=True))
    if gateway not in (None, "local"):
        connections.remember(target, ca_file)
    if print_token:
        typer.echo(cached.access_token)
    else:
        out.print(shown(f"logged in as {cached.username} at {target.gateway}; token cached in {target.token_cache}"),
                  markup=False)


def whoami(
    as_json: Annotated[bool, typer.Option("--json", help="The same as JSON; with no usable login, "
                                          "logged_in is false and the reason is given.")] = False,
) -> None:
    """Who the cached login is: user, roles, client, and when its access and refresh tokens expire.

    Read from the login cache on this host (no network). Exits 1 when there is no login or it has
    expired; `appliance token` logs in.
    """
    target = connection()
    try:
        view = login_view(login.cached_login(target), time.time())
    except login.LoginError as exc:
        if not as_json:
            raise
        out.print_json(json.dumps({"logged_in": False, "reason": exc.one_line()}))
        raise typer.Exit(1) from None
    view["cache"] = str(target.token_cache)
    view["gateway"] = target.gateway
    if as_json:
        out.print_json(json.dumps(view))
    else:
        _print_login(view)
    if not view["logged_in"]:
        if not as_json:
            raise ApplianceError(f"the cached login of {view['username']} has expired",
                                 hint="log in again: `appliance token`")
        raise typer.Exit(1)


def login_view(cached: login.CachedToken, now: float) -> dict[str, Any]:
    """What the cached login says of itself: its claims, read locally, and its tokens' expiry."""
    claims = login.token_claims(cached.access_token)
    access_left = cached.expires_at - now
    # As login.current_token: an expired access token is refreshed while the refresh token lasts.
    refresh_left = cached.refresh_expires_at - now if cached.refresh_token else 0.0
    return {
        "logged_in": access_left > 0 or refresh_left > 0,
        "username": cached.username,
        "subject": claims.get("sub"),
        "roles": login.realm_roles(claims),
        "client": claims.get("azp"),
        "issuer": claims.get("iss"),
        "access_token_expires_at": _iso(cached.expires_at),
        "access_token_expires_in_s": round(access_left),
        "refresh_token_expires_at": _iso(cached.refresh_expires_at) if cached.refresh_token else None,
        "refresh_token_expires_in_s": round(refresh_left) if cached.refresh_token else None,
    }


def _iso(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))


def _when(at: str | None, left_s: int | None) -> str:
    """'2025-06-01T12:00:00Z (in 4m12s)', or '... (expired 3m05s ago)'."""
    if at is None or left_s is None:
        return "none (a new login is needed once the access token expires)"
    return f"{at} (in {duration(left_s)})" if left_s > 0 else f"{at} (expired {duration(-left_s)} ago)"


def _print_login(view: dict[str, Any]) -> None:
    access_left = view["access_token_expires_in_s"]
    state = "" if access_left > 0 or not view["logged_in"] else "; the next command refreshes it"
    lines = [
        ("user", view["username"]),
        ("roles", ", ".join(view["roles"]) or "none"),
        ("client", view["client"] or "-"),
        ("issuer", view["issuer"] or "-"),
        ("access token", _when(view["access_token_expires_at"], access_left) + state),
        ("refresh token", _when(view["refresh_token_expires_at"], view["refresh_token_expires_in_s"])),
        ("gateway", view["gateway"]),
        ("cache", view["cache"]),
    ]
    for label, value in lines:
        # soft_wrap: a long issuer URL or path stays whole; the claims are shown as text, never markup
        out.print(shown(f"{label + ':':<15}{value}"), soft_wrap=True, highlight=False)
