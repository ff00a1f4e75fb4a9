"""Models and plan: the engine pools (a row per replica: its tier, health, requests in flight;
its address below the table), the response cache (size, hit rate; `f` flushes it), the batches
(`c` cancels one still running), each pool's plan (layout, per-GPU memory, the rejected layouts
and why) and the staging state of its weights."""

from __future__ import annotations

import asyncio
from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import DataTable, Label, Static

from tui.panel import Panel, gib


def plan_text(view: dict[str, Any]) -> str:
    """A pool's plan and staging state as lines of text."""
    lines = [f"Pool {view['pool']}: weights in {view['model_dir']}"]
    staging = view.get("staging")
    if staging:
        state = "complete" if staging["complete"] else "INCOMPLETE (resume with `appliance stage`)"
        lines.append(f"Staged ({staging['format']}, host {staging['host']}): {staging['files']} files, "
                     f"{gib(staging['bytes'])}, {state}")
    else:
        lines.append("Staging: not a staged directory (served as the checkpoint is)")
    if view.get("plan_error"):
        lines.append(f"Plan: {view['plan_error']}")
    plan = view.get("plan")
    if not plan:
        lines.append("Plan: none (pools.<name>.plan is unset; sizes come from the pool's settings)")
        return "\n".join(lines)
    model, hw = plan["model"], plan["hardware"]
    lines.append(f"Plan for {model['name']} ({model['total_params'] / 1e9:.1f}B params, {model['format']}) "
                 f"on {hw['hosts']}x{hw['gpus_per_host']}x{hw['gpu']} "
                 f"({gib(hw['gpu_memory_bytes'])} each), context {plan['target']['context']}")
    layout = plan.get("layout")
    if layout:
        lines.append(f"Layout: TP{layout['tp']} PP{layout['pp']} DP{layout['dp']} EP {'on' if layout['ep'] else 'off'}"
                     f" over {layout['gpus']} GPUs on {layout['hosts']} host(s)")
    per_gpu = plan.get("per_gpu")
    if per_gpu:
        lines.append(f"Per GPU: weights {gib(per_gpu['weights'])} + KV cache {gib(per_gpu['kv_cache'])} + "
                     f"reserve {gib(per_gpu['reserve'])} of budget {gib(per_gpu['budget'])}")
    if plan.get("kv_capacity_tokens"):
        lines.append(f"KV capacity {plan['kv_capacity_tokens']:,} tokens, "
                     f"{plan.get('max_concurrent_sequences')} sequences at full context")
    if not plan["feasible"]:
        lines.append("NOT FEASIBLE on this hardware")
    if plan["rejected"]:
        lines.append("Rejected:")
        for rejected in plan["rejected"]:
            lay = rejected["layout"]
            lines.append(f"  TP{lay['tp']} PP{lay['pp']} DP{lay['dp']}{' EP' if lay['ep'] else ''}: "
                         f"{rejected['reason']}")
    return "\n".join(lines)


CANCELLABLE = ("validating", "in_progress")  # a batch's states in which cancel applies


def cache_text(cache: dict[str, Any]) -> str:
    rate = "-" if cache["hit_rate"] is None else f"{cache['hit_rate']:.0%}"
    return (f"Cache ({'on' if cache['enabled'] else 'off'}, per {cache['scope']}): {cache['entries']} entries, "
            f"{cache['bytes'] / 2**20:.1f} MiB, hit rate {rate} ({cache['hits']} hits, {cache['misses']} misses, "
            f"{cache['bypasses']} bypasses)")


class Models(Panel):
    DEFAULT_CSS = Panel.DEFAULT_CSS + """
    #pools { height: auto; max-height: 10; }
    #cache { height: auto; padding: 0 1; }
    #batches { height: auto; max-height: 8; }
    #plan { height: 1fr; padding: 0 1; }
    Label { padding: 0 1; text-style: bold; }
    """

    # Listed in the titles (the footer lists the screens).
    BINDINGS = [Binding("f", "flush_cache", "flush", show=False),
                Binding("c", "cancel_batch", "cancel", show=False)]
    EMPTY = {"pools": "No engine replicas: each pool in the settings (`appliance settings`) runs its replicas "
                      "once `appliance up` starts them.",
             "batches": "No batches yet: users send them with OpenAI's Batch API (POST /v1/batches, see "
                        "docs/serve/batches.md); `appliance serving batches list` lists them too."}

    def __init__(self) -> None:
        super().__init__()
        self.plans: dict[str, dict[str, Any]] = {}
        self.pool_of: dict[str, str] = {}  # replica -> its pool
        self.urls: dict[str, str] = {}  # replica -> where its engine listens
        self.batch_states: dict[str, str] = {}
        self.cache_line = ""

    def body(self) -> ComposeResult:
        yield from self.listing("pools")
        yield Static("", id="cache", markup=False)
        yield Label("Batches", id="batches-title")
        yield from self.listing("batches")
        with VerticalScroll(id="plan"):
            yield Static("", id="plan-text", markup=False)

    def on_mount(self) -> None:
        self.query_one("#pools", DataTable).add_columns("replica", "model", "gpus", "engine", "tier", "in flight")
        self.query_one("#batches", DataTable).add_columns("batch", "owner", "state", "done", "failed", "endpoint")

    async def load(self) -> None:
        pools, plans, cache, batches = await asyncio.gather(
            self.client.call("GET", "/pools"), self.client.call("GET", "/plans"), self.client.call("GET", "/cache"),
            self.client.call("GET", "/batches"))
        self.plans = {view["pool"]: view for view in plans}
        self.cache_line = cache_text(cache)
        self._show_pools(pools)
        self._show_batches(batches.get("data", []))
        self._show_plan()

    def _show_pools(self, pools: list[dict[str, Any]]) -> None:
        self.pool_of = {r["name"]: p["name"] for p in pools for r in p["replicas"]}
        self.urls = {r["name"]: r["url"] for p in pools for r in p["replicas"]}
        self.fill("pools", [(r["name"], (r["name"], p["model"], ",".join(map(str, r["gpus"])) or "-",
                                         _engine_state(r), p["tier"] or "-", r["in_flight"]))
                            for p in pools for r in p["replicas"]])

    def _show_batches(self, listed: list[dict[str, Any]]) -> None:
        self.batch_states = {b["id"]: b["status"] for b in listed}
        self.fill("batches", [(b["id"], (b["id"], b.get("owner") or "-", b["status"], _done(b["request_counts"]),
                                         b["request_counts"]["failed"], _api(b["endpoint"])))
                              for b in listed])

    def offers(self, action: str, parameters: tuple[object, ...]) -> bool:
        if action == "cancel_batch":
            return self.batch_states.get(self.selected("batches") or "") in CANCELLABLE
        return True

    def show_keys(self) -> None:
        if self.cache_line:
            self.query_one("#cache", Static).update(self.titled(self.cache_line, ["flush_cache"]))
        self.query_one("#batches-title", Label).update(self.titled("Batches", ["cancel_batch"]))

    def action_cancel_batch(self) -> None:
        batch = self.selected("batches")
        if batch is not None:
            self.act(lambda: self.client.call("POST", f"/batches/{batch}/cancel"), f"batch {batch}: cancel asked",
                     question=f"Cancel batch {batch}? Requests running finish; no other starts.")

    def action_flush_cache(self) -> None:
        self.act(lambda: self.client.call("POST", "/cache/flush"), "response cache flushed",
                 question="Drop every cached answer?")

    def on_data_table_row_highlighted(self) -> None:
        self._show_plan()

    def _show_plan(self) -> None:
        """The selected replica's address, and its pool's plan and staging state."""
        replica = self.selected("pools") or ""
        view = self.plans.get(self.pool_of.get(replica, ""))
        lines = [f"Replica {replica} listens at {self.urls[replica]}"] if replica in self.urls else []
        self.query_one("#plan-text", Static).update("\n".join(lines + ([plan_text(view)] if view else [])))


def _engine_state(replica: dict[str, Any]) -> str:
    if not replica["healthy"]:
        return "DOWN"
    return "healthy" if replica["taking_requests"] else "returning"


def _api(endpoint: str) -> str:
    """A batch's endpoint in a word, "chat" or "completions": room for its owner at 80 columns."""
    return endpoint.removeprefix("/v1/").removesuffix("/completions")


def _done(counts: dict[str, int]) -> str:
    """A batch's requests answered, of all it holds."""
    return f"{counts['completed']}/{counts['total']}"
