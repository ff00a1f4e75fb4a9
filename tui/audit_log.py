"""Audit: the newest records with filters (user, action, outcome, since), a record's detail laid
out by field, and verification of the whole chain and its signed checkpoints.

The gateway records each read of the log but not an identical one repeated within its interval:
every refresh sends exactly the query last applied (filters change it only when submitted), so
that polling adds no records while a new query is recorded.

A record's detail: a line per field (label, value), nested objects (the target acted on, what
compliance filtering did) spelled out, and each hash on a line of its own so that it is never
broken. Only the fields the record has are shown: older records lack the newer ones, and fields
this version does not know come last, as they are."""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import DataTable, Input, Label, Select, Static

from appliance.terminal import shown
from tui.dialogs import Detail
from tui.panel import Panel

LIMIT = 200
OUTCOMES = ("allowed", "denied", "invalid", "error")
NEWEST: dict[str, str | int | bool] = {"newest": True, "limit": LIMIT}  # the query without filters

# (field, label) in the order shown; the fields below them are laid out their own way.
FIELDS = (("action", "action"), ("outcome", "outcome"), ("reason", "reason"), ("status", "HTTP status"),
          ("username", "user"), ("subject", "subject"), ("key", "API key"), ("client", "client"),
          ("source", "source"), ("model", "model"), ("tier", "tier"), ("replica", "replica"),
          ("target", "target"), ("resource", "resource"), ("batch", "batch request"),
          ("tools_called", "tools called"), ("sensitive", "sensitive data"), ("error", "error"),
          ("request_id", "request id"))
CAPTURED = (("prompt", "prompt"), ("params", "parameters"), ("completion", "completion"))
HASHES = (("prompt_hmac", "prompt HMAC"), ("completion_hmac", "completion HMAC"), ("params_hmac", "parameters HMAC"),
          ("prev_hash", "previous record's hash"), ("hash", "this record's hash"))
FIGURES = ("seq", "time", "prompt_tokens", "completion_tokens", "latency_ms", "cache_hit_of", "count")
KNOWN = {name for name, _ in FIELDS + CAPTURED + HASHES} | set(FIGURES)


def record_view(record: dict[str, Any]) -> RenderableType:
    """The record's fields by label, then any captured text, then its hashes."""
    parts: list[RenderableType] = [field_grid(record)]
    for name, label in CAPTURED:
        if present(record.get(name)):
            parts += [Text(""), Text(f"Captured {label}", style="bold"), shown(str(record[name]))]
    hashes = [(label, record[name]) for name, label in HASHES if present(record.get(name))]
    if hashes:
        parts.append(Text(""))
    for label, value in hashes:
        parts += [Text(label, style="bold"), unbroken(f"  {value}")]
    return Group(*parts)


def unbroken(value: str) -> Text:
    """A line never wrapped: a hash is compared by eye, so it must stay whole (cut, if at all, at
    its end on a screen too narrow for it)."""
    line = shown(value)
    line.no_wrap, line.overflow = True, "ellipsis"
    return line


def field_grid(record: dict[str, Any]) -> Table:
    """Label and value a row: the value column wraps within itself (a long value breaks where it
    must rather than running under the labels)."""
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    for label, value in rows(record):
        grid.add_row(shown(label), shown(value))  # Text: a str cell would be read as markup
    return grid


def rows(record: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) for each field the record has, in reading order."""
    found = [("time", when(record["time"]))] if present(record.get("time")) else []
    for name, label in FIELDS:
        if present(value := record.get(name)):
            found.append((label, target(value) if name == "target" else described(value)))
    found += figures(record)
    found += [(name, described(value)) for name, value in record.items() if name not in KNOWN and present(value)]
    return found


def figures(record: dict[str, Any]) -> list[tuple[str, str]]:
    """Tokens, latency, and what a cached answer or a summary record stands for."""
    found = []
    prompt, completion = record.get("prompt_tokens") or 0, record.get("completion_tokens") or 0
    if prompt or completion:
        found.append(("tokens", f"{prompt} in, {completion} out"))
    if record.get("latency_ms") is not None:
        found.append(("latency", f"{record['latency_ms']:.0f} ms"))
    if record.get("cache_hit_of") is not None:
        found.append(("cached answer", f"the answer of record {record['cache_hit_of']}"))
    if record.get("count") is not None:
        found.append(("stands for", f"{record['count']} requests"))
    return found


def target(value: Any) -> str:
    """The object acted on: "adapter support-bot v3" and, a line each, its other facts (roles: ...)."""
    if not isinstance(value, dict):
        return described(value)
    head = " ".join(str(value[k]) for k in ("kind", "name") if present(value.get(k)))
    if value.get("version") is not None:
        head += f" v{value['version']}"
    rest = {k: v for k, v in value.items() if k not in ("kind", "name", "version") and present(v)}
    return "\n".join(filter(None, [head, described(rest) if rest else ""]))


def described(value: Any) -> str:
    """A value as text: an object a line per key ("prompt.email: flagged"), a list comma-separated."""
    if isinstance(value, dict):
        return "\n".join(f"{key}: {described(item)}" for key, item in value.items() if present(item))
    if isinstance(value, list):
        return ", ".join(described(item) for item in value)
    return str(value)


def when(time: str) -> str:
    """A record's UTC time as people read it: 2026-12-01 03:00:00.123456 UTC."""
    return time.replace("T", " ").removesuffix("Z") + " UTC"


def present(value: Any) -> bool:
    """Whether a field holds something (None, "", [] and {} are left out)."""
    return value is not None and value != "" and value != [] and value != {}


class AuditLog(Panel):
    DEFAULT_CSS = Panel.DEFAULT_CSS + """
    #filters { height: 3; }
    #filters Input { width: 1fr; }
    #filters Select { width: 16; }
    #records { height: 1fr; }
    Label { padding: 0 1; text-style: bold; }
    #chain { height: auto; padding: 0 1; }
    """
    # Named in the records' title (the footer lists the screens).
    BINDINGS = [Binding("v", "verify", "verify the chain", show=False), Binding("f", "filters", "filter", show=False),
                Binding("escape", "records", "records", show=False)]
    EMPTY = {"records": "No audit records yet: every request through the gateway and every admin action "
                        "is recorded here."}
    NONE_MATCH = "No records match these filters: press f to change them (an empty field matches any)."

    def __init__(self) -> None:
        super().__init__()
        self.shown: dict[str, dict[str, Any]] = {}
        self.applied = dict(NEWEST)  # the query applied: what every refresh sends again

    def body(self) -> ComposeResult:
        with Horizontal(id="filters"):
            yield Input(placeholder="user", id="user")
            yield Input(placeholder="action", id="action")
            yield Select([(o, o) for o in OUTCOMES], prompt="outcome", id="outcome")
            yield Input(placeholder="since (UTC ISO)", id="since")
        yield Label("Records, newest first (enter: detail, f: filter, v: verify the chain)")
        yield from self.listing("records")
        yield Static("Chain not verified yet (v)", id="chain", markup=False)

    def on_mount(self) -> None:
        table = self.query_one("#records", DataTable)
        table.add_columns("time", "user", "action", "outcome", "status", "resource")
        table.focus()

    def filters(self) -> dict[str, str | int | bool]:
        """The query the filter fields ask for now."""
        params = dict(NEWEST)
        for name in ("user", "action", "since"):
            if value := self.query_one(f"#{name}", Input).value.strip():
                params[name] = value
        outcome = self.query_one("#outcome", Select).value
        if isinstance(outcome, str):
            params["outcome"] = outcome
        return params

    async def load(self) -> None:
        records = await self.client.call("GET", "/audit", params=self.applied)
        self.shown = {str(r["seq"]): r for r in records}
        self.fill("records", [(str(r["seq"]), (
            r["time"][5:19].replace("T", " "), r.get("username") or "-", r["action"],
            r["outcome"], r.get("status") or "-", r.get("resource") or "")) for r in records],
            empty=None if self.applied == NEWEST else self.NONE_MATCH, newest_first=True)

    def apply_filters(self) -> None:
        """A new query: the fields as they are now."""
        self.applied = self.filters()
        self.reload()

    def on_input_submitted(self) -> None:
        self.apply_filters()
        self.query_one("#records", DataTable).focus()

    def on_select_changed(self) -> None:
        self.apply_filters()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        record = self.shown.get(str(event.row_key.value))
        if record is not None:
            self.app.push_screen(Detail(f"Audit record {record['seq']}", record_view(record)))

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
