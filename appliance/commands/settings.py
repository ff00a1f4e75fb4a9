"""`appliance settings`: the settings in effect, their defaults, where the file lives; one
setting changed, and the changes applied to the running appliance (appliance.settings_changes)."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Annotated, Any

import typer

from appliance.changes import note_target, records_change
from appliance.commands.common import AsJson, old_spelling, print_json
from appliance.errors import Invalid
from appliance.home import Home

settings_app = typer.Typer(help="Show the settings file, its defaults and the values in effect; change one "
                           "setting; apply the changes to the running appliance.", no_args_is_help=True)

# What the command did, in words, for its audit record.
_done: ContextVar[str] = ContextVar("settings_done", default="")


@settings_app.command("show")
def settings_show(
    key: Annotated[str | None, typer.Argument(help="One setting, dotted: gateway.port, "
                                              "pools.main.enable_lora, gateway.limits.user.requests_per_minute."
                                              )] = None,
    as_json: AsJson = False,
    defaults: Annotated[bool, typer.Option("--defaults", help="Every setting with its default and meaning, as a "
                                           "commented TOML file (with --json: the defaults as JSON).")] = False,
    path: Annotated[bool, typer.Option("--path", help="Where the settings file lives "
                                       "(APPLIANCE_HOME/settings.toml).")] = False,
) -> None:
    """The settings in effect (file plus APPLIANCE_* overrides), as JSON, or one of them; secrets masked."""
    if defaults and path:
        raise Invalid("settings show: --defaults and --path: give one of them")
    if key is not None and (defaults or path):
        raise Invalid("settings show: a KEY shows the value in effect: leave out --defaults and --path")
    if path:
        _show_path(as_json)
    elif defaults:
        _show_defaults(as_json)
    else:
        _show_in_effect(key, as_json)


def _show_in_effect(key: str | None, as_json: bool) -> None:
    from rich.console import Console

    from appliance.settings import load_settings
    from appliance.settings.editing import render_value
    from appliance.settings_changes import show

    value = show(load_settings(Home.from_env().settings_file), key)
    if as_json:
        print_json(value if key is None else {"key": key, "value": value})
    elif isinstance(value, (dict, list)):
        Console().print_json(data=value)
    else:
        typer.echo("(unset)" if value is None else render_value(value))


@settings_app.command("set")
@records_change("settings.set", detail=_done.get)
def settings_set(
    key: Annotated[str, typer.Argument(help="The setting, dotted: gateway.port, pools.main.enable_lora.")],
    value: Annotated[str, typer.Argument(help="Its value as TOML (8443, true, [\"a\", \"b\"], "
                                         "'\"quoted\"'); anything else is taken as a string.")],
) -> None:
    """Set one setting in the settings file, validated with the whole file (nothing is written if
    it is refused); comments and the rest of the file are kept. `appliance settings apply` puts it
    into effect."""
    from appliance.settings_changes import set_value

    note_target("setting", key)
    change = set_value(Home.from_env(), key, value)
    _done.set(change.describe())
    typer.echo(f"{change.describe()}; `appliance settings apply` puts it into effect")
    if change.overridden_by:
        typer.echo(f"note: {change.overridden_by} is set in this environment and decides the value in effect",
                   err=True)


@settings_app.command("apply")
@records_change("settings.apply", detail=_done.get)
def settings_apply(as_json: AsJson = False) -> None:
    """Put changed settings in force: programs that take a key while running (the gateway its
    limits) without a restart, the others restarted one at a time, each healthy before the next
    (a pool's replicas one by one); with nothing changed, say so."""
    from rich.console import Console

    from appliance.commands.common import context
    from appliance.settings_changes import apply

    settings, home = context()
    note_target("service", "appliance")
    with Console(stderr=True).status("applying") as spinner:
        report = apply(settings, home, progress=lambda text: spinner.update(text))
    summary: dict[str, Any] = {"changed": report.plan.changed, "restarted": report.restarted,
                               "taken_live": report.taken_live, "notices": report.notices}
    _done.set(f"changed {', '.join(report.plan.changed) or 'nothing'}; "
              f"restarted {', '.join(report.restarted) or 'nothing'}"
              + (f"; taken without a restart by {', '.join(report.taken_live)}" if report.taken_live else ""))
    if as_json:
        print_json(summary)
        return
    if not report.plan.changed:
        typer.echo("nothing changed since the programs started")
        return
    typer.echo(f"changed: {', '.join(report.plan.changed)}")
    if report.taken_live:
        typer.echo(f"taken without a restart: {', '.join(report.taken_live)}")
    if report.restarted or not report.taken_live:
        typer.echo(f"restarted: {', '.join(report.restarted) or 'nothing (no running program reads them)'}")
    for notice in report.notices:
        typer.echo(notice)


def _show_defaults(as_json: bool) -> None:
    from appliance.settings import Settings, render_defaults

    if as_json:
        print_json(Settings().masked())
    else:
        typer.echo(render_defaults(), nl=False)


def _show_path(as_json: bool) -> None:
    settings_file = Home.from_env().settings_file
    if as_json:
        print_json({"path": str(settings_file)})
    else:
        typer.echo(settings_file)


def settings_defaults() -> None:
    _show_defaults(as_json=False)


def settings_path() -> None:
    _show_path(as_json=False)


old_spelling(settings_app, "settings defaults", "settings show --defaults", settings_defaults)
old_spelling(settings_app, "settings path", "settings show --path", settings_path)
