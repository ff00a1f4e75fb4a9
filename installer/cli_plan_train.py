"""`appliance plan MODEL --train lora|qlora ...`: the layout a sharded training run needs, explained."""

from __future__ import annotations

import json

import typer
from rich.console import Console

from appliance.errors import Invalid
from appliance.records import HardwareProfile
from appliance.terminal import Listing, text
from installer.memory import GIB
from installer.model_config import ModelShape
from installer.train_memory import DEFAULT_TARGETS, METHODS, TrainSpec
from installer.train_plan import MAX_HOSTS, TrainPlan, plan_training

out = Console()


def train_spec(method: str, rank: int, seq_len: int, batch: int, targets: str | None) -> TrainSpec:
    """The options of `plan --train` as a TrainSpec; errors name the option."""
    if method not in METHODS:
        raise Invalid(f"--train {method!r}: not one of {', '.join(METHODS)}")
    chosen = DEFAULT_TARGETS if targets is None else tuple(t.strip() for t in targets.split(",") if t.strip())
    try:
        return TrainSpec(method="qlora" if method == "qlora" else "lora", rank=rank, seq_len=seq_len, batch=batch,
                         targets=chosen)
    except Invalid as exc:  # TrainSpec names its fields; the operator typed options
        field, _, rest = exc.message.partition(" ")
        raise Invalid(f"--{field.replace('_', '-')} {rest}", hint=exc.hint) from None


def run(model: ModelShape, profile: HardwareProfile, spec: TrainSpec, *, ranks_per_host: int | None,
        as_json: bool, no_plan_exit: int) -> None:
    record = plan_training(model, profile, spec, ranks_per_host=ranks_per_host)
    if as_json:
        typer.echo(json.dumps(record.as_json(), indent=2))
    else:
        _explain(record)
    if not record.feasible:
        raise typer.Exit(no_plan_exit)


def _gib(value: int) -> str:
    return f"{value / GIB:.1f} GiB"


def _where(ranks: int, hosts: int, device: str) -> str:
    unit = "GPU" if device == "cuda" else "CPU rank"
    return f"{ranks} {unit}{'s' if ranks > 1 else ''} on {hosts} host{'s' if hosts > 1 else ''}"


def _explain(record: TrainPlan) -> None:
    model, hw, target = record.model, record.hardware, record.target
    device = hw["device"]
    out.print(f"[bold]{model['name']}[/bold] ({model['architecture']}): {model['total_params'] / 1e9:.1f}B "
              f"parameters; {target['method']} rank {target['rank']}, {target['seq_len']:,} tokens x "
              f"{target['batch']} rows a step; {record.adapter_params / 1e6:.1f}M adapter parameters")
    out.print(f"hardware: {hw['hosts']} host(s) x {hw['ranks_per_host']} x {hw['name']} "
              f"({_gib(hw['memory_bytes'])}); {_gib(hw['budget_per_rank'])} budget per rank", highlight=False)
    layout, per_rank = record.layout, record.per_rank
    if layout is not None and per_rank is not None:
        word = "[green]smallest that fits[/green]" if record.feasible else "[red]fits only on more hosts[/red]"
        out.print(f"{word}: {_where(layout['ranks'], layout['hosts'], device)} (FSDP2 over all ranks)")
        out.print(f"gradient checkpointing {record.checkpointing_why}", highlight=False)
        out.print(f"{_gib(per_rank['total'])} of a {_gib(per_rank['budget'])} budget", highlight=False)
        split = Listing("per rank", "bytes")
        for key, label in (("base_shard", "base shard"), ("quant_state", "quant state (NF4, on every rank)"),
                           ("adapter", "adapter (fp32 shard)"), ("optimizer", "adapter gradients + AdamW"),
                           ("activations_without_checkpointing", "activations without checkpointing"),
                           ("activations_with_checkpointing", "activations with checkpointing"),
                           ("buffers", "FSDP collective buffers"), ("runtime", "runtime"),
                           ("allocator", "allocator's kept buffers (a CPU's malloc)")):
            if key != "allocator" or per_rank.get(key):
                split.add_row(label, _gib(per_rank[key]))
        out.print(split, crop=False)
    else:
        out.print(f"[red]no layout fits on up to {MAX_HOSTS} hosts like these[/red]")
    for note in record.notes:
        out.print(f"note: {note}", highlight=False)
    rejected = Listing("layout", text("why it does not fit"))
    for item in record.rejected[-12:]:
        rejected.add_row(_where(item["ranks"], item["hosts"], device), item["reason"])
    if record.rejected:
        out.print(f"{len(record.rejected)} smaller layouts rejected; the 12 largest (--json lists all)",
                  highlight=False)
        out.print(rejected, crop=False)
