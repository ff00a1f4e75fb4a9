"""`appliance settings ...`: the settings file, its defaults and the values in effect."""

from __future__ import annotations

import typer

from appliance.home import Home

settings_app = typer.Typer(help="Show the settings file, its defaults and the values in effect.",
                           no_args_is_help=True)


@settings_app.command("show")
def settings_show() -> None:
    """The settings in effect (file plus APPLIANCE_* overrides), as JSON; secrets masked."""
    from rich.console import Console

    from appliance.settings import load_settings

    Console().print_json(data=load_settings(Home.from_env().settings_file).masked())


@settings_app.command("defaults")
def settings_defaults() -> None:
    """Every setting with its default and meaning, as a commented TOML file."""
    from appliance.settings import render_defaults

    typer.echo(render_defaults(), nl=False)


@settings_app.command("path")
def settings_path() -> None:
    """Where the settings file lives (APPLIANCE_HOME/settings.toml)."""
    typer.echo(Home.from_env().settings_file)
