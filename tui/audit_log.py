"""Audit: the newest records with filters (user, action, outcome, since), a record's detail, and
verification of the whole chain and its signed checkpoints."""

from __future__ import annotations

import json
from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import DataTable, Input, Select, Static

from tui.dialogs import Detail
from tui.panel import Panel, fill

LIMIT = 200
OUTCOMES = ("allowed", "denied", "error")


class AuditLog(Panel):
    DEFAULT_CSS = Panel.DEFAULT_CSS + """
    #filters { height: 3; }
    #filters Input { width: 1fr; }
    #filters Select { width: 16; }
    #records { height: 1fr; }
    #chain { height: auto; padding: 0 1; }
    """
    BINDINGS = [Binding("v", "verify", "Verify chain"), Binding("f", "filters", "Filter"),
                Binding("escape", "records", "Records", show=False)]

    def __init__(self) -> None:
        super().__init__()
        self.shown: dict[str, dict[str, Any]] = {}

    def body(self) -> ComposeResult:
        with Horizontal(id="filters"):
            yield Input(placeholder="user", id="user")
            yield Input(placeholder="action", id="action")
            yield Select([(o, o) for o in OUTCOMES], prompt="outcome", id="outcome")
            yield Input(placeholder="since (UTC ISO)", id="since")
        yield DataTable(id="records", cursor_type="row")
        yield Static("Chain not verified yet (v)", id="chain", markup=False)

    def on_mount(self) -> None:
        super().on_mount()
        table = self.query_one("#records", DataTable)
        table.add_columns("time", "user", "action", "outcome", "status", "resource")
        table.focus()

    def filters(self) -> dict[str, str | int | bool]:
        params: dict[str, str | int | bool] = {"newest": True, "limit": LIMIT}
        for name in ("user", "action", "since"):
            if value := self.query_one(f"#{name}", Input).value.strip():
                params[name] = value
        outcome = self.query_one("#outcome", Select).value
        if isinstance(outcome, str):
            params["outcome"] = outcome
        return params

    async def load(self) -> None:
        records = await self.client.call("GET", "/audit", params=self.filters())
        self.shown = {str(r["seq"]): r for r in records}
        fill(self.query_one("#records", DataTable),
             [(str(r["seq"]), (r["time"][5:19].replace("T", " "), r.get("username") or "-", r["action"],
                               r["outcome"], r.get("status") or "-", r.get("resource") or ""))
              for r in records])

    def on_input_submitted(self) -> None:
        self.reload()
        self.query_one("#records", DataTable).focus()

    def on_select_changed(self) -> None:
        self.reload()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        record = self.shown.get(str(event.row_key.value))
        if record is not None:
            self.app.push_screen(Detail(f"Audit record {record['seq']}", json.dumps(record, indent=1)))

    def action_filters(self) -> None:
        self.query_one("#user", Input).focus()

    def action_records(self) -> None:
        self.query_one("#records", DataTable).focus()

    def action_verify(self) -> None:
        async def verify() -> None:
            self.query_one("#chain", Static).update("Verifying the chain ...")
            result = await self.client.call("POST", "/audit/verify")
            self.query_one("#chain", Static).update(
                f"Chain verified: {result['records']} records, {result['checkpoints']} signed checkpoints "
                f"(last at seq {result['last_checkpoint_seq']})" if result["ok"]
                else f"CHAIN BROKEN at {result['where']}: {result['reason']}")

        self.act(verify, "audit chain checked")
