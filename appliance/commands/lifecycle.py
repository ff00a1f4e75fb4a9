"""`appliance up`, `down` and `status`: the appliance's processes as one unit under supervisord."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any
from urllib.parse import urlsplit

import typer
from rich.console import Console
from rich.measure import Measurement

if TYPE_CHECKING:  # rich.table is imported only when something runs: `status` of a stopped appliance is instant
    from rich.console import ConsoleOptions, Group, RenderableType, RenderResult
    from rich.table import Column, Table

from appliance import lifecycle
from appliance.changes import records_change
from appliance.home import Home
from appliance.terminal import Listing, duration, shown, text

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
        out.print("already up; nothing changed (`appliance settings apply` puts changed settings in force)")
    elif report.finished:
        out.print(f"finished an interrupted `up` ({', '.join(report.finished)})", highlight=False)
    else:
        out.print(f"up in {max(report.startup_s.values(), default=0):.0f}s")
    for notice in report.notices:
        out.print(notice, highlight=False)
    running = lifecycle.status(home)
    print_status(out, running)  # fits the terminal; `status --wide` has pids and sockets
    print_endpoints(out, running["programs"])


@records_change("appliance.down")
def down() -> None:
    """Stop every program and supervisord, and end any process they left behind."""
    home = Home.from_env()
    with err.status("stopping"):
        report = lifecycle.down(home)
    if not report.was_running:
        # supervisord died hard: what it ran may still be running, and is stopped all the same.
        out.print("supervisord was not running; its programs left running are stopped" if report.ended_leftovers
                  else "not running; nothing to stop")
    else:
        out.print("down: supervisord and all programs stopped")
    if report.ended_leftovers:
        out.print(f"ended leftover processes (pids): {', '.join(map(str, report.ended_leftovers))}")


def status(
    wide: Annotated[bool, typer.Option(
        "--wide", help="Also the pool, pid and every URL each program serves, one per line; lines may "
        "then be longer than the terminal, but no URL is split.")] = False,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Everything, machine-readable: every program's state, pid, URLs and log, and the cluster.")
    ] = False,
) -> None:
    """Programs as supervisord sees them: state, health, uptime, GPUs, model and what each serves.

    The table fits 80 columns: `serves` is the port (`:8080`) or `socket` (an engine's Unix
    socket); `--wide` adds the pool, the pid and the full URLs, `--json` everything.
    """
    report = lifecycle.status(Home.from_env())
    if as_json:
        out.print_json(json.dumps(report))
        return
    if not report["supervisord"]["running"]:
        out.print("down (supervisord is not running)")
        if report["up"]["running"]:
            out.print(up_line(report["up"]), highlight=False)
        return
    print_status(out, report, wide=wide)


def print_status(console: Console, report: dict[str, Any], *, wide: bool = False) -> None:
    """The programs, each pool spanning hosts, and where the logs are."""
    if wide:
        console.print(Unbounded(wide_table(report["programs"])), crop=False)
    else:
        console.print(programs_table(report["programs"]), crop=False)
    for pool in report["cluster"]:
        console.print(cluster_table(pool), crop=False)
    if (up := report.get("up")) is not None and (line := up_line(up)) is not None:
        console.print(line, soft_wrap=True, highlight=False, markup=False)
    if (alerts := report.get("alerts")) is not None:
        console.print(alerts_line(alerts), soft_wrap=True, highlight=False, markup=False)
    # soft_wrap: a long state directory stays one line rather than being cut mid-path
    console.print(f"logs: {report['home']}/logs", soft_wrap=True, highlight=False)


def print_endpoints(console: Console, programs: list[dict[str, Any]]) -> None:
    """Where the appliance is reached over the network, one `program what URL` a line, each URL
    whole (an engine's own socket is the gateway's to use: `status --wide` shows it)."""
    lines = [f"  {p['name']} {what} {url}" for p in programs for what, url in p["urls"].items()
             if not url.startswith("unix:")]
    if lines:
        console.print("reach it at:", highlight=False)
    for line in lines:
        console.print(line, soft_wrap=True, highlight=False, markup=False)


def up_line(up: dict[str, Any]) -> str | None:
    """An `up` under way, or one that did not finish (killed half-way), and its steps left."""
    left = ", ".join(up["steps_left"]) or "none"
    if up["running"]:
        return f"`appliance up` is under way (steps left: {left})"
    if up["steps_left"]:
        return f"`appliance up` did not finish (steps left: {left}): run `appliance up` to finish it"
    return None


def alerts_line(alerts: dict[str, Any]) -> str:
    """The firing alerts that need someone (`appliance alerts` has all), or why they are unknown."""
    from appliance.alerts import summary

    return f"alerts: unknown ({alerts['error']})" if alerts["error"] else f"alerts: {summary(alerts['firing'])}"


def _table(*columns: Column) -> Table:
    """No borders, one space between columns (as `ps` and the listings)."""
    from rich.table import Table

    return Table(*columns, box=None, padding=(0, 1, 0, 0), pad_edge=False, header_style="bold")


def _whole(header: str) -> Column:
    """A column whose lines are never wrapped or cut (URLs): the table grows instead."""
    from rich.table import Column

    return Column(header, no_wrap=True, overflow="ignore")


def programs_table(programs: list[dict[str, Any]]) -> Listing:
    """The compact table: every value is short, so it fits 80 columns without breaking a word (on
    a narrower terminal, a block of lines a program)."""
    table = Listing("program", "state", "health", "uptime", "gpus", "serves", "model")
    for p in programs:
        table.add_row(p["name"], p["state"], _health(p), duration(p["uptime_s"]), gpu_ranges(p["gpus"]),
                      short_serves(p), p["model"] or "-")
    return table


def wide_table(programs: list[dict[str, Any]]) -> Table:
    """Every column and every URL (`name url`, one per line), at the table's natural width."""
    table = _table(*map(_whole, ("program", "pool", "state", "health", "pid", "uptime", "gpus", "model", "serves")))
    for p in programs:
        urls = "\n".join(f"{name} {url}" for name, url in p["urls"].items()) or "-"
        table.add_row(p["name"], p["pool"] or "-", p["state"], _health(p), str(p["pid"] or "-"),
                      duration(p["uptime_s"]), gpu_ranges(p["gpus"]), p["model"] or "-", urls)
    return table


def cluster_table(pool: dict[str, Any]) -> Group:
    """A pool spanning hosts, titled with its state: each rank's host, state, epoch and last heartbeat."""
    from rich.console import Group

    title = f"pool {pool['pool']} across hosts: {'serving' if pool['ready'] else pool['why']} (epoch {pool['epoch']})"
    table = Listing("node", "host", text("host state"), "rank", "pid", "epoch", text("last heartbeat"))
    for rank in pool["ranks"]:
        seen = rank["seen_s_ago"]
        table.add_row(str(rank["node"]), rank["host"], rank["host_state"], "up" if rank["running"] else "down",
                      str(rank["pid"] or "-"), str(rank["epoch"]), "-" if seen is None else f"{seen:.1f} s ago")
    return Group(shown(title), table)


class Unbounded:
    """A renderable drawn at its natural width even past the console's: lines may run long (the
    terminal wraps them; a log keeps them whole), but Rich never breaks a value inside."""

    def __init__(self, renderable: RenderableType) -> None:
        self.renderable = renderable

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        natural = Measurement.get(console, options.update(width=_UNBOUNDED), self.renderable).maximum
        yield from console.render(self.renderable, options.update(width=max(natural, options.max_width)))


_UNBOUNDED = 100_000  # wider than any table status draws


def _health(program: dict[str, Any]) -> str:
    return "ok" if program["healthy"] else "no"


def gpu_ranges(gpus: list[int]) -> str:
    """GPU indexes as one word with runs joined: [0, 1, 2, 3, 6] -> 0-3,6; none -> -."""
    runs: list[list[int]] = []
    for gpu in sorted(gpus):
        if runs and gpu == runs[-1][-1] + 1:
            runs[-1].append(gpu)
        else:
            runs.append([gpu])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs) or "-"


def short_serves(program: dict[str, Any]) -> str:
    """Where a program listens, short: its loopback port (:8080), `socket` (a Unix socket), else the
    ports of the URLs it serves."""
    if program["port"]:
        return f":{program['port']}"
    if program["socket"]:
        return "socket"
    ports = [f":{port}" for url in program["urls"].values() if (port := urlsplit(url).port)]
    return ",".join(dict.fromkeys(ports)) or "-"
