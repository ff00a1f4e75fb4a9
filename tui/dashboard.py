"""Dashboard: supervised services with start/stop/restart, host usage (GPUs from NVML, else CPU
and memory) and the gateway's live traffic with small charts."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import DataTable, Sparkline, Static

from tui.metrics import Rates, Scrape, parse, rates
from tui.panel import Panel, duration, fill, gib, selected_key

HISTORY = 60  # samples per chart


class Dashboard(Panel):
    REFRESH_S = 2.0
    DEFAULT_CSS = Panel.DEFAULT_CSS + """
    #services { height: auto; max-height: 9; }
    #gpus { height: auto; max-height: 6; }
    #host, #traffic { height: auto; padding: 0 1; }
    .chart { height: 1; }
    .chart Static { width: 14; padding: 0 1; }
    .chart Sparkline { width: 1fr; }
    """
    BINDINGS = [Binding("s", "service('start')", "Start"), Binding("t", "service('stop')", "Stop"),
                Binding("r", "service('restart')", "Restart")]

    def __init__(self) -> None:
        super().__init__()
        self.last: Scrape | None = None
        self.history: dict[str, deque[float]] = {name: deque([0.0], maxlen=HISTORY)
                                                 for name in ("requests", "tokens", "p50")}

    def body(self) -> ComposeResult:
        yield DataTable(id="services", cursor_type="row")
        yield Static("", id="host", markup=False)
        yield DataTable(id="gpus", cursor_type="none", show_cursor=False)
        yield Static("Gateway: waiting for a second sample", id="traffic", markup=False)
        for name, label in (("requests", "requests/s"), ("tokens", "tokens/s"), ("p50", "p50 ms")):
            with Horizontal(classes="chart"):
                yield Static(label)
                yield Sparkline(list(self.history[name]), id=f"chart-{name}")

    def on_mount(self) -> None:
        super().on_mount()
        self.query_one("#services", DataTable).add_columns("service", "state", "pid", "uptime", "restarts")
        self.query_one("#gpus", DataTable).add_columns("gpu", "name", "util", "memory", "temp")
        self.query_one("#gpus", DataTable).display = False

    async def load(self) -> None:
        services, usage, text = await asyncio.gather(
            self.client.call("GET", "/services"), self.client.call("GET", "/system"), self.client.metrics_text())
        fill(self.query_one("#services", DataTable),
             [(s["name"], (s["name"], s["state"], s["pid"] or "-", duration(s["uptime_s"]) if s["pid"] else "-",
                           s["restarts"])) for s in services])
        self._show_host(usage)
        scrape = parse(text, time.monotonic())
        if self.last is not None:
            self._show_traffic(rates(self.last, scrape))
        self.last = scrape

    def _show_host(self, usage: dict[str, Any]) -> None:
        gpus = self.query_one("#gpus", DataTable)
        line = (f"CPU {usage['cpu_percent']:.0f}% of {usage['cpu_count']} cores (load {usage['load_1m']:.2f})   "
                f"RAM {gib(usage['memory_used_bytes'])} / {gib(usage['memory_total_bytes'])}")
        if usage["gpus"]:
            fill(gpus, [(str(g["index"]), (g["index"], g["name"], f"{g['utilization_percent']}%",
                                           f"{gib(g['memory_used_bytes'])} / {gib(g['memory_total_bytes'])}",
                                           "-" if g["temperature_c"] is None else f"{g['temperature_c']} C"))
                        for g in usage["gpus"]])
        else:
            line += f"\nNo GPU figures: {usage.get('gpu_error') or 'no GPUs'}"
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

    def action_service(self, action: str) -> None:
        name = selected_key(self.query_one("#services", DataTable))
        if name is None:
            return
        question = None if action == "start" else f"{action.capitalize()} the service {name!r}?"
        self.act(lambda: self.client.call("POST", f"/services/{name}/{action}"), f"{name}: {action} done", question)
