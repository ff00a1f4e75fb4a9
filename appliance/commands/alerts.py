"""`appliance alerts`: the alerts firing now (through the gateway's admin API)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from appliance.commands.common import admin_api, print_json
from appliance.terminal import Listing, shown, text

out = Console()


def alerts(json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False) -> None:
    """Alerts firing now, the most urgent first: name, severity, since, what it is about, summary."""
    from appliance.alerts import is_heartbeat, summary  # httpx: only when this command runs

    firing = admin_api("GET", "/alerts")
    if json:
        print_json(firing)
        return
    urgent = [alert for alert in firing if not is_heartbeat(alert)]
    if not urgent:
        out.print(f"alerts: {summary(firing)}", markup=False)
        return
    table = Listing("alert", "severity", "since", text("about"), text("summary"))
    for alert in urgent:
        about = ", ".join(f"{k}={v}" for k, v in alert["labels"].items() if k not in ("job", "instance"))
        # Shown as text: no markup, and no escape sequence of a label's (an engine's) reaches the terminal.
        table.add_row(*(shown(cell) for cell in (alert["name"], alert["severity"],
                                                  alert["since"][:19].replace("T", " "), about, alert["summary"])))
    out.print(table, crop=False)
    if len(urgent) < len(firing):
        out.print("heartbeat ok (the Watchdog alert fires while alerting works; it is not counted)", markup=False)
