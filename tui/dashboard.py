"""Dashboard: supervised services with start/stop/restart (each offered where it applies), the
alerts firing, host usage (GPUs from NVML, else CPU and memory) and the gateway's live traffic with
small charts."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import DataTable, Label, Sparkline, Static

from appliance.admin_client import Refused
from appliance.alerts import summary
from appliance.errors import Unavailable
from tui.metrics import Rates, Scrape, parse, rates
from tui.panel import Panel, duration, fill, gib

HISTORY = 60  # samples per chart
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
    #services { height: auto; max-height: 9; }
    #gpus { height: auto; max-height: 6; }
    #host, #traffic { height: auto; padding: 0 1; }
    .chart { height: 1; }
    .chart Static { width: 14; padding: 0 1; }
    .chart Sparkline { width: 1fr; }
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
        self.history: dict[str, deque[float]] = {name: deque([0.0], maxlen=HISTORY)
                                                 for name in ("requests", "tokens", "p50")}

    def body(self) -> ComposeResult:
        yield Label("Services", id="services-title")
        yield from self.listing("services")
        yield Static("Alerts: waiting for Alertmanager", id="alerts", markup=False)
        yield Static("", id="host", markup=False)
        yield DataTable(id="gpus", cursor_type="none", show_cursor=False)
        yield Static("Gateway: waiting for a second sample", id="traffic", markup=False)
        for name, label in (("requests", "requests/s"), ("tokens", "tokens/s"), ("p50", "p50 ms")):
            with Horizontal(classes="chart"):
                yield Static(label)
                yield Sparkline(list(self.history[name]), id=f"chart-{name}")

    def on_mount(self) -> None:
        self.query_one("#services", DataTable).add_columns("service", "state", "pid", "uptime", "restarts")
        self.query_one("#gpus", DataTable).add_columns("gpu", "name", "util", "memory", "temp")
        self.query_one("#gpus", DataTable).display = False

    async def load(self) -> None:
        services, usage, text, alerts = await asyncio.gather(
            self.client.call("GET", "/services"), self.client.call("GET", "/system"), self.client.metrics_text(),
            self._alerts())
        self.query_one("#alerts", Static).update(alerts)
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
        for name, value in (("requests", now.requests_per_s), ("tokens", now.tokens_out_per_s),
                            ("p50", (now.p50_s or 0.0) * 1000)):
            self.history[name].append(value)
            self.query_one(f"#chart-{name}", Sparkline).data = list(self.history[name])

    def offers(self, action: str, parameters: tuple[object, ...]) -> bool:
        if action != "service":
            return True
        name, applies = self.selected("services"), ACTIONS.get(str(parameters[0]) if parameters else "", ())
        return name is not None and name != "gateway" and self.states.get(name, "") in applies

    def show_keys(self) -> None:
        title = self.titled("Services", ["service"])
        if self.selected("services") == "gateway":  # it serves this screen: say where it is stopped
            title = "Services (the gateway stops with `appliance down`)"
        self.query_one("#services-title", Label).update(title)

    def action_service(self, action: str) -> None:
        name = self.selected("services")
        if name is None:
            return
        question = None if action == "start" else f"{action.capitalize()} the service {name!r}?"
        self.act(lambda: self.client.call("POST", f"/services/{name}/{action}"), f"{name}: {action} done", question)


def _percent(value: int | None) -> str:
    """A GPU's utilisation, or "-" where it does not report one."""
    return "-" if value is None else f"{value}%"
