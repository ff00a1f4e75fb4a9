"""Dashboard: supervised services with start/stop/restart (each offered where it applies), the
alerts firing, host usage (GPUs from NVML, else CPU and memory), the gateway's live traffic, and
charts of the key series over the last minutes as the appliance's Prometheus holds them (/charts:
the Grafana dashboard's expressions)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import DataTable, Label, Sparkline, Static

from appliance.admin_client import Refused
from appliance.alerts import summary
from appliance.errors import Unavailable
from tui.metrics import Rates, Scrape, parse, rates
from tui.panel import Panel, duration, fill, gib

# supervisord's states in which each action applies; the gateway serves this screen and takes none.
STARTABLE = ("STOPPED", "EXITED", "FATAL")
STOPPABLE = ("RUNNING", "STARTING", "BACKOFF")
RESTARTABLE = ("RUNNING",)
ACTIONS = {"start": STARTABLE, "stop": STOPPABLE, "restart": RESTARTABLE}
# NVML's words when there is no NVIDIA driver at all, as on a CPU-only host.
NO_DRIVER = ("Shared Library Not Found", "Driver Not Loaded")


def gpu_line(usage: dict[str, Any]) -> str:
    """Why there are no GPU figures: no GPU here (said plainly), or NVML failing on a GPU host."""
    error = usage.get("gpu_error")
    if not error or any(words in error for words in NO_DRIVER):
        return "This host has no GPU: the CPU engine serves the models."
    return f"GPU figures unavailable: {error}"


class Dashboard(Panel):
    REFRESH_S = 2.0
    DEFAULT_CSS = Panel.DEFAULT_CSS + """
    #services { height: auto; max-height: 50%; }  /* every service at 120x40; past that it scrolls */
    #gpus { height: auto; max-height: 6; }
    #host, #traffic, #charts-state { height: auto; padding: 0 1; }
    #charts { height: auto; }
    .chart { height: 1; }
    .chart .chart-label { width: 16; padding: 0 1; }
    .chart Sparkline { width: 1fr; }
    .chart .chart-value { width: 12; padding: 0 1; text-align: right; }
    Label { padding: 0 1; text-style: bold; }
    """
    # Listed in the services' title (the footer lists the screens).
    BINDINGS = [Binding("s", "service('start')", "start", show=False),
                Binding("t", "service('stop')", "stop", show=False),
                Binding("r", "service('restart')", "restart", show=False)]

    EMPTY = {"services": "No services: supervisord runs none. Start the appliance with `appliance up`."}

    def __init__(self) -> None:
        super().__init__()
        self.states: dict[str, str] = {}  # service -> its supervisord state
        self.last: Scrape | None = None

    def body(self) -> ComposeResult:
        yield Label("Services", id="services-title")
        yield from self.listing("services")
        yield Static("Alerts: waiting for Alertmanager", id="alerts", markup=False)
        yield Static("", id="host", markup=False)
        yield DataTable(id="gpus", cursor_type="none", show_cursor=False)
        yield Static("Gateway: waiting for a second sample", id="traffic", markup=False)
        yield Static("Charts: waiting for Prometheus", id="charts-state", markup=False)
        yield Vertical(id="charts")  # a row a series, added as the first answer names them

    def on_mount(self) -> None:
        self.query_one("#services", DataTable).add_columns("service", "state", "pid", "uptime", "restarts")
        self.query_one("#gpus", DataTable).add_columns("gpu", "name", "util", "memory", "temp")
        self.query_one("#gpus", DataTable).display = False

    async def load(self) -> None:
        services, usage, text, alerts, charts = await asyncio.gather(
            self.client.call("GET", "/services"), self.client.call("GET", "/system"), self.client.metrics_text(),
            self._alerts(), self._charts())
        self.query_one("#alerts", Static).update(alerts)
        await self._show_charts(charts)
        self.states = {s["name"]: s["state"] for s in services}
        self.fill("services", [(s["name"], (s["name"], s["state"], s["pid"] or "-",
                                            duration(s["uptime_s"]) if s["pid"] else "-", s["restarts"]))
                               for s in services])
        self._show_host(usage)
        scrape = parse(text, time.monotonic())
        if self.last is not None:
            self._show_traffic(rates(self.last, scrape))
        self.last = scrape

    async def _alerts(self) -> str:
        """The firing alerts that need someone; why there are none to show, if so."""
        try:
            return f"Alerts: {summary(await self.client.call('GET', '/alerts'))}"
        except (Refused, Unavailable) as exc:  # monitoring off, or Alertmanager not answering
            return f"Alerts: unknown ({exc.message})"

    async def _charts(self) -> list[dict[str, Any]] | str:
        """The key series from Prometheus; why there are none to show, if so."""
        try:
            found: list[dict[str, Any]] = await self.client.call("GET", "/charts")
            return found
        except (Refused, Unavailable) as exc:  # monitoring off, or Prometheus not answering
            return f"Charts: unknown ({exc.message})"

    async def _show_charts(self, charts: list[dict[str, Any]] | str) -> None:
        """A row a series (its label, its points, its latest value), or, in their place, why not."""
        area, state = self.query_one("#charts", Vertical), self.query_one("#charts-state", Static)
        area.display = not isinstance(charts, str)  # no stale line stands for now
        if isinstance(charts, str):
            state.update(charts)
            return
        minutes = round((len(charts[0]["points"]) - 1) * charts[0]["step_s"] / 60) if charts else 0
        state.update(f"Charts: the last {minutes} min, from Prometheus" if charts else "Charts: none")
        for series in charts:
            points = [p for p in series["points"] if p is not None]  # a gap is no sample, not a zero
            latest = series["points"][-1] if series["points"] else None
            shown = "no data" if not points else "-" if latest is None else value_text(latest, series["unit"])
            row_id = f"chart-{series['name']}"
            if not area.query(f"#{row_id}"):
                await area.mount(Horizontal(Static(series["label"], classes="chart-label", markup=False),
                                            Sparkline(), Static(classes="chart-value", markup=False),
                                            id=row_id, classes="chart"))
            row = area.query_one(f"#{row_id}", Horizontal)
            row.query_one(Sparkline).data = points
            row.query_one(Sparkline).display = bool(points)  # no flat line where there is no sample
            row.query_one(".chart-value", Static).update(shown)

    def _show_host(self, usage: dict[str, Any]) -> None:
        gpus = self.query_one("#gpus", DataTable)
        line = (f"CPU {usage['cpu_percent']:.0f}% of {usage['cpu_count']} cores (load {usage['load_1m']:.2f})   "
                f"RAM {gib(usage['memory_used_bytes'])} / {gib(usage['memory_total_bytes'])}")
        if usage["gpus"]:
            fill(gpus, [(str(g["index"]), (g["index"], g["name"], _percent(g["utilization_percent"]),
                                           f"{gib(g['memory_used_bytes'])} / {gib(g['memory_total_bytes'])}",
                                           "-" if g["temperature_c"] is None else f"{g['temperature_c']} C"))
                        for g in usage["gpus"]])
        else:
            line += f"\n{gpu_line(usage)}"
        gpus.display = bool(usage["gpus"])
        self.query_one("#host", Static).update(line)

    def _show_traffic(self, now: Rates) -> None:
        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value * 1000:.0f} ms"

        self.query_one("#traffic", Static).update(
            f"Gateway /v1: {now.requests_per_s:.1f} req/s   p50 {ms(now.p50_s)}  p95 {ms(now.p95_s)}  "
            f"p99 {ms(now.p99_s)}\ntokens/s in {now.tokens_in_per_s:.0f} out {now.tokens_out_per_s:.0f}   "
            f"errors/s {now.errors_per_s:.2f}   refused/s {now.refused_per_s:.2f}")

    def offers(self, action: str, parameters: tuple[object, ...]) -> bool:
        if action != "service":
            return True
        name, applies = self.selected("services"), ACTIONS.get(str(parameters[0]) if parameters else "", ())
        return name is not None and name != "gateway" and self.states.get(name, "") in applies

    def show_keys(self) -> None:
        # The count: where the table scrolls, how many there are to scroll to.
        services = f"Services: {len(self.states)}"
        title = self.titled(services, ["service"])
        if self.selected("services") == "gateway":  # it serves this screen: say where it is stopped
            title = f"{services} (the gateway stops with `appliance down`)"
        self.query_one("#services-title", Label).update(title)

    def action_service(self, action: str) -> None:
        name = self.selected("services")
        if name is None:
            return
        question = None if action == "start" else f"{action.capitalize()} the service {name!r}?"
        self.act(lambda: self.client.call("POST", f"/services/{name}/{action}"), f"{name}: {action} done", question)


def value_text(value: float, unit: str) -> str:
    """A chart's latest value in its unit (appliance/charts.py names them)."""
    if unit == "ratio":
        return f"{value * 100:.1f}%"
    if unit == "s":
        return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"
    if unit in ("req/s", "tok/s"):
        return f"{value:.1f} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{value:g}"


def _percent(value: int | None) -> str:
    """A GPU's utilisation, or "-" where it does not report one."""
    return "-" if value is None else f"{value}%"
