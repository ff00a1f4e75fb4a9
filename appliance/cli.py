"""The `appliance` command: the CLI root, its lifecycle commands, and commands packages add."""

from __future__ import annotations

import json
import time
import traceback
from importlib.metadata import entry_points
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Column, Table
from rich.text import Text

from appliance import cli_access, cli_hosts, lifecycle
from appliance.changes import records_change
from appliance.cli_serving import serving_app
from appliance.errors import ApplianceError
from appliance.home import Home
from appliance.settings import load_settings, render_defaults
from appliance.terminal import shown

COMMANDS_GROUP = "appliance.commands"

app = typer.Typer(
    help="On-prem LLM appliance: serve open-weight models through vLLM under supervisord.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
settings_app = typer.Typer(help="Show the settings file, its defaults and the values in effect.",
                           no_args_is_help=True)
app.add_typer(settings_app, name="settings")
cli_access.register(app)
cli_hosts.register(app)
app.add_typer(serving_app, name="serving")

out = Console()
err = Console(stderr=True)
_state = {"verbose": False}


@app.callback()
def _root(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show tracebacks on errors.")] = False,
) -> None:
    _state["verbose"] = verbose


def _settings_in_effect() -> str:
    return f"settings {load_settings(Home.from_env().settings_file).digest()}"


@app.command()
@records_change("appliance.up", detail=_settings_in_effect)  # a changed digest: settings changed
def up() -> None:
    """Start supervisord and every engine pool; wait until each answers; print what runs where."""
    home = Home.from_env()
    settings = load_settings(home.settings_file)
    with err.status("starting") as spinner:
        report = lifecycle.up(settings, home, progress=lambda text: spinner.update(text))
    if report.already_up:
        out.print("already up; nothing changed (`appliance down` first to apply new settings)")
    else:
        out.print(f"up in {max(report.startup_s.values(), default=0):.0f}s")
    for notice in report.notices:
        out.print(notice, highlight=False)
    _print_programs(lifecycle.status(home))


@app.command()
@records_change("appliance.down")
def down() -> None:
    """Stop every program and supervisord, and end any process they left behind."""
    home = Home.from_env()
    with err.status("stopping"):
        report = lifecycle.down(home)
    if not report.was_running:
        out.print("not running; nothing to stop")
    else:
        out.print("down: supervisord and all programs stopped")
    if report.ended_leftovers:
        out.print(f"ended leftover processes: {report.ended_leftovers}")


@app.command()
def status(
    as_json: Annotated[bool, typer.Option("--json", help="Every program's state and URLs as JSON.")] = False,
) -> None:
    """Programs as supervisord sees them (pool, pid, state, uptime, model, port) and their health."""
    report = lifecycle.status(Home.from_env())
    if as_json:
        out.print_json(json.dumps(report))
        return
    if not report["supervisord"]["running"]:
        out.print("down (supervisord is not running)")
        return
    _print_programs(report)


def _print_programs(report: dict[str, Any]) -> None:
    table = Table(*(Column(name, overflow="fold") for name in
                    ("program", "pool", "gpus", "state", "pid", "uptime", "model", "serves", "health")))
    for p in report["programs"]:
        table.add_row(p["name"], p["pool"] or "-", ",".join(map(str, p["gpus"])) or "-", p["state"],
                      str(p["pid"] or "-"),
                      time.strftime("%H:%M:%S", time.gmtime(p["uptime_s"])), p["model"] or "-",
                      " ".join(p["urls"].values()), "ok" if p["healthy"] else "no")
    out.print(table)
    for pool in report["cluster"]:
        ranks = Table(*(Column(name, overflow="fold") for name in
                        ("node", "host", "host state", "rank", "pid", "epoch", "last heartbeat")),
                      title=f"pool {pool['pool']} across hosts: {'serving' if pool['ready'] else pool['why']} "
                            f"(epoch {pool['epoch']})")
        for rank in pool["ranks"]:
            seen = rank["seen_s_ago"]
            ranks.add_row(str(rank["node"]), rank["host"], rank["host_state"], "up" if rank["running"] else "down",
                          str(rank["pid"] or "-"), str(rank["epoch"]), "-" if seen is None else f"{seen:.1f} s ago")
        out.print(ranks)
    out.print(f"logs: {report['home']}/logs")


@settings_app.command("show")
def settings_show() -> None:
    """The settings in effect (file plus APPLIANCE_* overrides), as JSON; secrets masked."""
    home = Home.from_env()
    out.print_json(data=load_settings(home.settings_file).masked())


@settings_app.command("defaults")
def settings_defaults() -> None:
    """Every setting with its default and meaning, as a commented TOML file."""
    typer.echo(render_defaults(), nl=False)


@settings_app.command("path")
def settings_path() -> None:
    """Where the settings file lives (APPLIANCE_HOME/settings.toml)."""
    typer.echo(Home.from_env().settings_file)


def _register_package_commands() -> None:
    for ep in entry_points(group=COMMANDS_GROUP):
        ep.load()(app)


def main() -> None:
    """Console-script entry: run the app; an ApplianceError becomes one line and exit code 1."""
    _register_package_commands()
    try:
        app()  # standalone: usage errors, --help and exit codes are handled by Typer
    except ApplianceError as exc:
        line = exc.one_line()
        _record(line)
        err.print(Text("error: ", style="red") + shown(line), soft_wrap=True)  # never markup: it may quote input
        if _state["verbose"]:
            err.print(traceback.format_exc())
        raise SystemExit(1) from None


def _record(line: str) -> None:
    """Append a reported error to the appliance log, if the state directory exists."""
    home = Home.from_env()
    log = lifecycle.appliance_log(home)
    if log.parent.is_dir():
        with log.open("a") as handle:
            handle.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} error: {line}\n")
