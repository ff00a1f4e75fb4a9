"""`appliance serving ...`: the engine pools with their tiers and replicas, the routing policy, the
response cache and the batches, through the gateway's admin API. Each is a group of its own
(`serving pools list`, `serving cache flush`, `serving batches cancel ID`); the old spellings
(`serving pools`, `serving flush-cache`, `serving cancel-batch`, ...) keep working for one release."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

import typer
from rich.console import Console

from appliance.commands.common import AsJson, admin_api, defaulting_to, old_spelling, print_json
from appliance.terminal import Listing

serving_app = typer.Typer(help="Tiers, replicas, routing, the response cache and batches (through the gateway's "
                          "admin API).",
                          no_args_is_help=True)
pools_app = typer.Typer(cls=defaulting_to("list", "serving pools"),
                        help="Engine pools: their model, tier and replicas, and the routing policy.")
cache_app = typer.Typer(cls=defaulting_to("show", "serving cache"), help="The response cache.")
batches_app = typer.Typer(cls=defaulting_to("list", "serving batches"), help="Every user's batches.")
serving_app.add_typer(pools_app, name="pools")
serving_app.add_typer(cache_app, name="cache")
serving_app.add_typer(batches_app, name="batches")
out = Console()


@pools_app.command("list")
def pools_list(as_json: AsJson = False) -> None:
    """Each pool's model and tier, and its replicas: health, requests in flight, GPUs."""
    routing = admin_api("GET", "/routing")
    if as_json:
        print_json(routing)
        return
    table = Listing("pool", "model", "tier", "replica", "engine", "in flight", "gpus")
    for pool in routing["pools"]:
        for replica in pool["replicas"]:
            state = "DOWN" if not replica["healthy"] else "healthy" if replica["taking_requests"] else "returning"
            table.add_row(pool["name"], pool["model"], pool["tier"] or "-", replica["name"], state,
                          str(replica["in_flight"]), ",".join(map(str, replica["gpus"])) or "-")
    out.print(table, crop=False)
    out.print(policy_line(routing["policy"], {pool["tier"] for pool in routing["pools"] if pool["tier"]}),
              highlight=False)


def policy_line(policy: dict[str, Any], tiers: set[str]) -> str:
    """The routing policy in words; its tier rules only where the pools have tiers (the policy's
    defaults name tiers that may not exist)."""
    balance = f"replicas balanced by {policy['balance']}"
    if not tiers:
        return f"policy: no pool has tiers; {balance}"
    return (f"policy: streamed requests for a bare model name -> tier {policy['interactive_tier'] or '-'} (prompts "
            f"up to {policy['long_prompt_chars']} characters), others -> tier {policy['default_tier']}; {balance}")


@cache_app.command("show")
def cache_show(as_json: AsJson = False) -> None:
    """The response cache: entries, bytes, hits, misses, hit rate."""
    stats: dict[str, Any] = admin_api("GET", "/cache")
    if as_json:
        print_json(stats)
        return
    rate = "-" if stats["hit_rate"] is None else f"{stats['hit_rate']:.1%}"
    out.print(f"response cache {'on' if stats['enabled'] else 'off'} (shared per {stats['scope']}, ttl "
              f"{stats['ttl_s']:g} s): {stats['entries']}/{stats['max_entries']} entries, {stats['bytes']:,}/"
              f"{stats['max_bytes']:,} bytes; {stats['hits']} hits, {stats['misses']} misses, {stats['bypasses']} "
              f"bypasses; hit rate {rate}", highlight=False)


@cache_app.command("flush")
def cache_flush() -> None:
    """Drop every cached answer."""
    flushed = admin_api("POST", "/cache/flush")["flushed"]
    out.print(f"response cache flushed: {flushed} entries dropped", highlight=False)


@batches_app.command("list")
def batches_list(as_json: AsJson = False,
                 limit: Annotated[int, typer.Option(min=1, max=100, help="How many, newest first.")] = 20) -> None:
    """Every user's batches: owner, state, request counts, endpoint, when created."""
    listed = admin_api("GET", "/batches", params={"limit": limit})
    if as_json:
        print_json(listed)
        return
    table = Listing("batch", "owner", "state", "done", "failed", "total", "endpoint", "created")
    for batch in listed["data"]:
        counts = batch["request_counts"]
        table.add_row(batch["id"], batch.get("owner") or "-", batch["status"], str(counts["completed"]),
                      str(counts["failed"]), str(counts["total"]), batch["endpoint"], _when(batch["created_at"]))
    out.print(table, crop=False)


@batches_app.command("cancel")
def batches_cancel(batch_id: Annotated[str, typer.Argument(help="The batch's id (batch_...).")]) -> None:
    """Stop anyone's batch: requests running finish, no other starts."""
    batch = admin_api("POST", f"/batches/{batch_id}/cancel")
    out.print(f"batch {batch['id']} is {batch['status']}", highlight=False)


old_spelling(serving_app, "serving flush-cache", "serving cache flush", cache_flush)
old_spelling(serving_app, "serving cancel-batch", "serving batches cancel", batches_cancel)


def _when(stamp: int) -> str:
    return datetime.fromtimestamp(stamp, UTC).strftime("%Y-%m-%d %H:%M:%S")
