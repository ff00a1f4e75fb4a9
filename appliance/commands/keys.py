"""`appliance keys ...`: API keys for applications, through the gateway's admin API (a user
manages their own keys, an administrator anyone's). A key's name is its owner's: two users may
each have a key of the same name, and `--user` says whose."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

import typer
from rich.console import Console

from appliance.api_keys import expiry
from appliance.commands.common import admin_api, print_json
from appliance.errors import Invalid
from appliance.terminal import Listing

keys_app = typer.Typer(help="API keys for applications: create (shown once), list, limit, revoke, remove.",
                       no_args_is_help=True)
out = Console()
Name = Annotated[str, typer.Argument(help="The key's name: lower-case letters, digits, '.', '_' and '-'.")]
Json = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
Whose = Annotated[str | None, typer.Option("--user", help="Whose key it is (administrators; unset: yours, or the "
                                           "one user's who has a key of that name).")]


@keys_app.command("create")
def keys_create(
    name: Name,
    user: Annotated[str, typer.Option("--user", help="The user the key acts as (only an administrator may name "
                                      "another user).")],
    expires_in: Annotated[str | None, typer.Option("--expires-in", help="A duration: 12h, 30d, 52w (s, m, h, d or "
                                                   "w); unset: until revoked.")] = None,
    model: Annotated[list[str] | None, typer.Option("--model", "--models", help="A model it may use; repeatable; "
                                                    "unset: every model its user may use.")] = None,
    tokens_per_minute: Annotated[int | None, typer.Option("--tokens-per-minute", help="Its own token budget, on "
                                                          "top of its user's.")] = None,
    json: Json = False,
) -> None:
    """Create an API key and print it once: the appliance keeps only a keyed hash of it."""
    expiry(expires_in, datetime.now(UTC), name="--expires-in")  # a bad value is told here, naming the option
    body: dict[str, Any] = {"name": name, "owner": user, "expires_in": expires_in, "models": model or None,
                            "tokens_per_minute": tokens_per_minute}
    created = admin_api("POST", "/keys", json=body)
    if json:
        print_json(created)
        return
    out.print(f"API key {created['name']} created for {created['owner']}"
              f"{', expires ' + created['expires'] if created['expires'] else ''}", markup=False)
    out.print("the key (shown once; store it as the application's secret):", markup=False)
    typer.echo(created["secret"])


@keys_app.command("list")
def keys_list(
    user: Annotated[str | None, typer.Option("--user", help="Only this user's keys (administrators).")] = None,
    json: Json = False,
) -> None:
    """API keys: name, prefix, owner, state, created, expires, last used."""
    keys = admin_api("GET", "/keys", params={"owner": user} if user else None)
    if json:
        print_json(keys)
        return
    if not keys:
        out.print("no API keys yet: `appliance keys create NAME --user USER` makes one", markup=False)
        return
    table = Listing("name", "prefix", "owner", "state", "created", "expires", "last used")
    for key in keys:
        table.add_row(key["name"], key["prefix"], key["owner"], key["state"], _day(key["created"]),
                      _day(key["expires"]) or "never", _day(key["last_used"]) or "never")
    out.print(table, crop=False)


@keys_app.command("limit")
def keys_limit(
    name: Name,
    user: Whose = None,
    model: Annotated[list[str] | None, typer.Option("--model", "--models", help="A model it may use from now on; "
                                                    "repeatable; replaces the models it was limited to.")] = None,
    all_models: Annotated[bool, typer.Option("--all-models", help="Lift its model limit: every model its user "
                                             "may use.")] = False,
    tokens_per_minute: Annotated[int | None, typer.Option("--tokens-per-minute", help="Its own token budget from "
                                                          "now on, on top of its user's.")] = None,
    no_token_limit: Annotated[bool, typer.Option("--no-token-limit", help="Lift its own token budget: its user's "
                                                 "budget only.")] = False,
    json: Json = False,
) -> None:
    """Change an active API key's limits (its models, its own token budget); what is not named is kept."""
    for given, lifted, option, lift in ((model, all_models, "--model", "--all-models"),
                                        (tokens_per_minute is not None, no_token_limit, "--tokens-per-minute",
                                         "--no-token-limit")):
        if given and lifted:
            raise Invalid(f"{option} and {lift} together: give one", hint=f"{lift} lifts the limit {option} sets")
    body: dict[str, Any] = {}
    if model or all_models:
        body["models"] = model or None
    if tokens_per_minute is not None or no_token_limit:
        body["tokens_per_minute"] = tokens_per_minute
    if not body:
        raise Invalid("no limit to change", hint="give --model (or --all-models), --tokens-per-minute (or "
                      "--no-token-limit), or both")
    key = admin_api("PATCH", f"/keys/{name}", json=body, params={"owner": user} if user else None)
    if json:
        print_json(key)
        return
    models = ", ".join(key["models"]) if key["models"] else f"any model {key['owner']} may use"
    budget = (f"{key['tokens_per_minute']} tokens/min of its own" if key["tokens_per_minute"]
              else f"{key['owner']}'s token budget only")
    out.print(f"API key {key['name']} of {key['owner']} now limited to {models}; {budget}", markup=False)


@keys_app.command("revoke")
def keys_revoke(name: Name, user: Whose = None) -> None:
    """Revoke an API key: its next request is refused."""
    key = admin_api("POST", f"/keys/{name}/revoke", params={"owner": user} if user else None)
    out.print(f"API key {key['name']} of {key['owner']} revoked", markup=False)


@keys_app.command("remove")
def keys_remove(name: Name, user: Whose = None) -> None:
    """Delete a revoked or expired API key from the registry (administrators); its name is free again."""
    key = admin_api("DELETE", f"/keys/{name}", params={"owner": user} if user else None)
    out.print(f"API key {key['name']} of {key['owner']} removed", markup=False)


def _day(stamp: str | None) -> str:
    """An ISO time to the minute, UTC."""
    return stamp[:16].replace("T", " ") if stamp else ""
