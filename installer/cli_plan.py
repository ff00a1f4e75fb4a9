"""`appliance plan MODEL ...`: choose and explain a parallel layout for a model on some hardware."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from appliance.errors import ApplianceError, Invalid
from appliance.home import Home
from appliance.records import HardwareProfile, Plan, PlanLayout
from appliance.settings import PoolSettings, load_settings
from appliance.terminal import Listing, text
from installer import cli_plan_train
from installer.hardware import detect, load_profile, parse_hardware_spec
from installer.memory import GIB
from installer.model_config import load_model_config
from installer.planner import OBJECTIVES, LaunchSite, Objective, Pins, plan, speculation

NO_PLAN_EXIT = 3
out = Console()


def plan_command(
    model: Annotated[Path, typer.Argument(help="Checkpoint directory or a bare config.json.")],
    profile: Annotated[Path | None, typer.Option(help="Hardware profile file (JSON or TOML).")] = None,
    detect_here: Annotated[bool, typer.Option("--detect", help="Profile this host now.")] = False,
    hardware: Annotated[str | None, typer.Option(help="Shorthand HOSTSxGPUSxNAME-MEMORY, e.g. 2x8xH100-80GB.")] = None,
    context: Annotated[int, typer.Option(min=1, max=2**31, help="Tokens per sequence (prompt + output).")] = 8192,
    concurrency: Annotated[int, typer.Option(min=1, max=10**6,
                                             help="Sequences that must fit at full context at once.")] = 1,
    format: Annotated[str | None, typer.Option(help="Weight format: bf16, fp16, fp8, int4, nf4 "
                                                    "(default: the checkpoint's own).")] = None,
    tp: Annotated[int | None, typer.Option(min=1, help="Pin the tensor-parallel size.")] = None,
    pp: Annotated[int | None, typer.Option(min=1, help="Pin the pipeline-parallel size.")] = None,
    dp: Annotated[int | None, typer.Option(min=1, help="Pin the data-parallel size.")] = None,
    ep: Annotated[bool | None, typer.Option("--ep/--no-ep", help="Pin expert parallelism on or off.")] = None,
    speculative: Annotated[str | None, typer.Option(help="Plan for speculative decoding: 'mtp' (the model's own "
                                                          "multi-token-prediction layers) or a draft model's "
                                                          "checkpoint directory or config.json.")] = None,
    speculative_tokens: Annotated[int, typer.Option(min=1, max=64, help="Tokens proposed a step.")] = 1,
    objective: Annotated[str, typer.Option(help="What to choose for: 'capacity' (the most KV-cache tokens on the "
                                               "GPUs here, then fewer hosts, then less traffic between hosts) or "
                                               "'min-gpus' (the fewest GPUs, leaving the rest free).")] = "capacity",
    pool: Annotated[str, typer.Option(help="The pool the printed launch is for (its settings, if configured).")]
    = "main",
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan record as JSON.")] = False,
    train: Annotated[str | None, typer.Option(help="Size a sharded training run instead: 'lora' or 'qlora' "
                                                   "(FSDP2 over every rank).")] = None,
    rank: Annotated[int, typer.Option(help="--train: LoRA's rank.")] = 8,
    seq_len: Annotated[int, typer.Option(help="--train: tokens per training row.")] = 512,
    batch: Annotated[int, typer.Option(help="--train: rows per micro-batch on each rank.")] = 4,
    targets: Annotated[str | None, typer.Option(help="--train: where adapters go, comma-separated: attention, "
                                                     "mlp, shared_experts, routed_experts (default: all but "
                                                     "routed_experts, as the trainer's all-linear).")] = None,
    processes: Annotated[int | None, typer.Option(help="--train on CPU hosts: ranks per host (they share its "
                                                       "RAM; default 1).")] = None,
) -> None:
    """Plan TP x PP x DP x EP for MODEL; exit 0 with a feasible plan, 3 when none fits. The launch
    printed for a one-host plan is what `appliance up` runs for a pool that names it; across hosts,
    the head fills in each rank's cluster address, interface and (on workers) paths at join.
    With --train, the smallest layout that trains an adapter on MODEL instead, and why smaller
    ones do not fit."""
    if train is not None:
        serving = [name for name, value in (("--tp", tp), ("--pp", pp), ("--dp", dp), ("--ep/--no-ep", ep),
                                            ("--format", format), ("--speculative", speculative)) if value is not None]
        if serving:
            raise Invalid(f"{', '.join(serving)}: serving options; --train sizes its own FSDP layout")
        spec = cli_plan_train.train_spec(train, rank, seq_len, batch, targets)
        cli_plan_train.run(load_model_config(model), _hardware(profile, detect_here, hardware), spec,
                           ranks_per_host=processes, as_json=as_json, no_plan_exit=NO_PLAN_EXIT)
        return
    shape, site = load_model_config(model), _site(pool)
    record = plan(shape, _hardware(profile, detect_here, hardware), context=context,
                  concurrency=concurrency, fmt=format, pins=Pins(tp=tp, pp=pp, dp=dp, ep=ep),
                  model_ref=str(model), site=site, objective=_objective(objective),
                  speculative=speculation(shape, speculative, speculative_tokens),
                  reserved={p.name: p.gpus for p in site.settings.pools if p.name != pool and p.gpus})
    if as_json:
        typer.echo(record.model_dump_json(indent=2))
    else:
        _explain(record)
    if not record.feasible:
        raise typer.Exit(NO_PLAN_EXIT)


def _objective(value: str) -> Objective:
    for known in OBJECTIVES:
        if value == known:
            return known
    raise ApplianceError(f"--objective {value!r}: not one of {', '.join(OBJECTIVES)}")


def _site(pool_name: str) -> LaunchSite:
    """The launch site: this appliance's settings and state dir, and the pool's settings."""
    home = Home.from_env()
    settings = load_settings(home.settings_file)
    configured = next((p for p in settings.pools if p.name == pool_name), None)
    return LaunchSite(pool=configured or PoolSettings(name=pool_name), settings=settings, home=home)


def _hardware(profile: Path | None, detect_here: bool, hardware: str | None) -> HardwareProfile:
    given = [name for name, value in (("--profile", profile), ("--detect", detect_here), ("--hardware", hardware))
             if value]
    if len(given) != 1:
        raise ApplianceError(f"give exactly one of --profile, --detect, --hardware (got {', '.join(given) or 'none'})")
    if profile is not None:
        return load_profile(profile)
    return detect() if detect_here else parse_hardware_spec(str(hardware))


def _layout(layout: PlanLayout) -> str:
    return f"TP{layout.tp} x PP{layout.pp} x DP{layout.dp}{' + EP' if layout.ep else ''}"


def _explain(record: Plan) -> None:
    model, hw = record.model, record.hardware
    out.print(f"[bold]{model.name}[/bold] ({model.architecture}): {model.total_params / 1e9:.1f}B parameters, "
              f"{model.active_params / 1e9:.1f}B active, weights as {model.format}")
    out.print(f"hardware: {hw.hosts} host(s) x {hw.gpus_per_host} x {hw.gpu} ({hw.gpu_memory_bytes / GIB:.0f} GiB), "
              f"NVLink inside hosts: {'yes' if hw.nvlink else 'no'}")
    if record.layout is not None and record.per_gpu is not None:
        per_gpu = record.per_gpu
        out.print(f"[green]chosen[/green]: {_layout(record.layout)} on {record.layout.gpus} GPUs "
                  f"({record.layout.hosts} host(s))")
        out.print(f"why: {record.choice}", highlight=False)
        out.print(f"per GPU: weights {per_gpu.weights / GIB:.1f} GiB, reserve {per_gpu.reserve / GIB:.1f} GiB, "
                  f"KV cache {per_gpu.kv_cache / GIB:.1f} GiB of a {per_gpu.budget / GIB:.1f} GiB budget; "
                  f"{record.kv_bytes_per_token:,} KV bytes/token; {record.kv_capacity_tokens:,} tokens in all; "
                  f"{record.max_concurrent_sequences} sequences of {record.target.context:,} tokens")
        for alternative in record.alternatives[:5]:
            out.print(f"  also fits: {_layout(alternative.layout)} on {alternative.layout.gpus} GPUs "
                      f"({alternative.kv_capacity_tokens:,} KV tokens)")
        for command in record.commands:
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in command.env.items())
            out.print(f"[bold]{command.host}[/bold] ({command.role}): {env} {shlex.join(command.argv)}",
                      soft_wrap=True, highlight=False)
        for note in record.notes:
            out.print(f"note: {note}")
    else:
        out.print("[red]no layout fits[/red]")
        smallest = record.smallest_fitting_hardware
        if smallest:
            out.print(f"smallest hardware that fits: {smallest.hosts} hosts x {smallest.gpus_per_host} x "
                      f"{smallest.gpu} with {_layout(smallest.layout)}")
    if len(record.alternatives) > 5:
        out.print(f"  and {len(record.alternatives) - 5} more that fit (--json lists all)")
    closest = sorted(record.rejected, key=lambda item: -item.layout.gpus)[:12]
    out.print(f"{len(record.rejected)} layouts rejected; the {len(closest)} largest (--json lists all)",
              highlight=False)
    rejected = Listing("rejected layout", text("why"))
    for item in closest:
        rejected.add_row(_layout(item.layout), item.reason)
    out.print(rejected, crop=False)
