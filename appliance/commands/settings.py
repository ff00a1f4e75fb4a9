"""`appliance settings show`: the settings in effect, their defaults, or where the file lives."""

from __future__ import annotations

from typing import Annotated

import typer

from appliance.commands.common import AsJson, old_spelling, print_json
from appliance.errors import Invalid
from appliance.home import Home

settings_app = typer.Typer(help="Show the settings file, its defaults and the values in effect.",
                           no_args_is_help=True)


@settings_app.command("show")
def settings_show(
    as_json: AsJson = False,
    defaults: Annotated[bool, typer.Option("--defaults", help="Every setting with its default and meaning, as a "
                                           "commented TOML file (with --json: the defaults as JSON).")] = False,
    path: Annotated[bool, typer.Option("--path", help="Where the settings file lives "
                                       "(APPLIANCE_HOME/settings.toml).")] = False,
) -> None:
    """The settings in effect (file plus APPLIANCE_* overrides), as JSON; secrets masked."""
    if defaults and path:
        raise Invalid("settings show: --defaults and --path: give one of them")
    if path:
        _show_path(as_json)
    elif defaults:
        _show_defaults(as_json)
    else:
        _show_in_effect(as_json)


def _show_in_effect(as_json: bool) -> None:
    from rich.console import Console

    from appliance.settings import load_settings

    masked = load_settings(Home.from_env().settings_file).masked()
    if as_json:
        print_json(masked)
    else:
        Console().print_json(data=masked)


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
