"""`appliance up`, `down` and `status`: the appliance's processes as one unit under supervisord."""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import typer
from rich.console import Console

from appliance import lifecycle
from appliance.changes import records_change
from appliance.home import Home

out = Console()
err = Console(stderr=True)


def _settings_in_effect() -> str:
    from appliance.settings import load_settings

    return f"settings {load_settings(Home.from_env().settings_file).digest()}"


@records_change("appliance.up", detail=_settings_in_effect)  # a changed digest: settings changed
def up() -> None:
    """Start supervisord and every engine pool; wait until each answers; print what runs where."""
    from appliance.settings import load_settings  # `status` needs no settings

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
    from rich.table import Column, Table  # only when something runs

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
