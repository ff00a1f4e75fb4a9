"""What the core's commands share: this host's settings and state directory, the gateway's admin
API, a password from standard input, the one way every `--json` prints, and the old spellings of
renamed commands kept for one release (docs/operate/cli.md; how help reads is appliance.help_style).
What is heavy is imported where used."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperGroup

from appliance.errors import ApplianceError
from appliance.home import Home

if TYPE_CHECKING:
    from typer import _click  # the Click that Typer vendors

    from appliance.connection import Connection
    from appliance.settings import Settings

# Every list and show command takes it; the JSON is what the table shows, whole.
AsJson = Annotated[bool, typer.Option("--json", help="Print it as JSON, for scripts.")]


def context() -> tuple[Settings, Home]:
    """This host's settings and its state directory (created if missing)."""
    from appliance.settings import load_settings

    home = Home.from_env().ensure()
    return load_settings(home.settings_file), home


def connection() -> Connection:
    """Where this user's logins and admin calls go: the remote appliance they chose, else this host's."""
    from appliance import connection as connections

    return connections.current(context)


def admin_api(method: str, path: str, **kwargs: Any) -> Any:
    """One call of the gateway's admin API with the cached administrator token; its JSON answer."""
    from appliance.admin_client import AdminClient

    return AdminClient(connection()).call_sync(method, path, **kwargs)


def read_password() -> str:
    """The first line of standard input (--password-stdin)."""
    password = sys.stdin.readline().rstrip("\n")
    if not password:
        raise ApplianceError("--password-stdin: no password on standard input")
    return password


def print_json(data: Any) -> None:
    """`data` (dicts, lists, pydantic models, dataclasses) as indented JSON on standard output:
    plain text, never Rich markup or colour, so a pipe gets exactly the JSON."""
    from pydantic_core import to_jsonable_python

    typer.echo(json.dumps(to_jsonable_python(data), indent=1, ensure_ascii=False))


def old_spelling(app: typer.Typer, old: str, new: str, command: Callable[..., Any]) -> None:
    """Register `command` under its old spelling (`old`, the whole path after `appliance`) too:
    hidden, and saying on standard error that it is now `new`, so scripts keep working for one
    release."""

    @functools.wraps(command)
    def renamed(*args: Any, **kwargs: Any) -> Any:
        _say_renamed(old, new)
        return command(*args, **kwargs)

    app.command(old.split()[-1], hidden=True,
                help=f"The old spelling of `appliance {new}`, kept for one release.")(renamed)


def _say_renamed(old: str, new: str) -> None:
    typer.echo(f"`appliance {old}` is now `appliance {new}`; the old spelling goes in the next release", err=True)


def defaulting_to(default: str, old: str) -> type[TyperGroup]:
    """A group class that runs its `default` command when given none (or only options): `old`
    was a command before it became this group, and keeps working so for one release."""

    class Defaulting(TyperGroup):
        def parse_args(self, ctx: _click.Context, args: list[str]) -> list[str]:
            if not args or (args[0].startswith("-") and args[0] not in ctx.help_option_names):
                _say_renamed(old, f"{old} {default}")
                args = [default, *args]
            return super().parse_args(ctx, args)

    return Defaulting
