"""Sizing a sharded LoRA/QLoRA training run: the smallest layout (ranks and hosts) on which every
rank fits (installer.train_memory), gradient checkpointing only where it is needed to fit, and
why each smaller layout does not; and the check a trainer makes before it loads anything.

Layouts, smallest first: 1 to G ranks on one host of G GPUs, then whole hosts (2G, 3G, ...) up to
MAX_HOSTS; on CPU hosts, `ranks_per_host` ranks on each of 1, 2, ... hosts, each rank's budget
its share of the host's RAM.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from appliance.errors import Invalid
from appliance.job_fit import JobFit, JobShape
from appliance.records import HardwareProfile
from installer.hardware import local_host
from installer.memory import GIB, count_params
from installer.model_config import ModelShape, load_model_config
from installer.train_memory import (
    DEFAULT_TARGETS,
    Device,
    Dtype,
    Method,
    RankMemory,
    TrainSpec,
    adapter_params,
    rank_memory,
)

MAX_HOSTS = 64
# A GPU's budget: its memory less a margin for the caching allocator's fragmentation.
GPU_UTILIZATION = 0.95


class TrainPlanError(Invalid):
    """A training run that cannot be sized (bad hardware, bad inputs)."""


@dataclass(frozen=True)
class TrainFit:
    """Whether one layout fits: the per-rank split as chosen (checkpointing only when needed)."""

    ranks: int
    hosts: int
    budget: int
    memory: RankMemory
    reason: str | None  # None: it fits

    @property
    def fits(self) -> bool:
        return self.reason is None


def fit(model: ModelShape, spec: TrainSpec, *, ranks: int, hosts: int, budget: int, device: Device) -> TrainFit:
    """Without checkpointing if that fits, else with it if that fits, else the reason (with it)."""
    if ranks < 1 or hosts < 1 or ranks < hosts:
        raise TrainPlanError(f"ranks {ranks} over hosts {hosts}: need at least one rank a host")
    if budget < 1:
        raise TrainPlanError(f"per-rank memory {budget}: must be more than 0 bytes")
    plain = rank_memory(model, spec, ranks, device, checkpointing=False)
    if plain.total <= budget:
        return TrainFit(ranks, hosts, budget, plain, None)
    checkpointed = rank_memory(model, spec, ranks, device, checkpointing=True)
    if checkpointed.total <= budget:
        return TrainFit(ranks, hosts, budget, checkpointed, None)
    return TrainFit(ranks, hosts, budget, checkpointed, _why_not(checkpointed, budget))


def _why_not(memory: RankMemory, budget: int) -> str:
    """Names the figure that does not fit: one too large alone, else the largest of the total."""
    figures = memory.figures()
    name, largest = next(iter(figures.items()))
    split = ", ".join(f"{k} {_gib(v)}" for k, v in figures.items())
    if largest > budget:
        return f"{name} {_gib(largest)} alone exceeds the {_gib(budget)} per-rank budget ({split})"
    return (f"{_gib(memory.total)} per rank exceeds the {_gib(budget)} budget by {_gib(memory.total - budget)}; "
            f"the largest figure is {name} {_gib(largest)} ({split})")


def _gib(value: int) -> str:
    return f"{value / GIB:.1f} GiB"


@dataclass
class TrainPlan:
    """`plan --train`'s record (JSON with --json)."""

    model: dict[str, Any]
    hardware: dict[str, Any]
    target: dict[str, Any]
    feasible: bool
    layout: dict[str, int] | None = None  # ranks, hosts, ranks_per_host: the smallest that fits
    per_rank: dict[str, int] | None = None
    checkpointing: bool | None = None
    checkpointing_why: str | None = None
    adapter_params: int = 0
    rejected: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def plan_training(model: ModelShape, profile: HardwareProfile, spec: TrainSpec, *,
                  ranks_per_host: int | None = None) -> TrainPlan:
    """The smallest layout that fits on hosts like the profile's (up to MAX_HOSTS): feasible when
    the profile has that many hosts. GPU hosts train one rank a GPU; CPU hosts (no GPUs)
    `ranks_per_host` ranks each (default 1)."""
    device, per_host, budget, name, memory_bytes = _hardware(profile, ranks_per_host)
    params = count_params(model)
    record = TrainPlan(
        model={"name": model.name, "architecture": model.architecture, "config_sha256": model.config_sha256,
               "total_params": params.total, "experts": bool(model.experts)},
        hardware={"hosts": len(profile.hosts), "device": device, "ranks_per_host": per_host, "name": name,
                  "memory_bytes": memory_bytes, "budget_per_rank": budget},
        target={"method": spec.method, "rank": spec.rank, "seq_len": spec.seq_len, "batch": spec.batch,
                "targets": list(spec.targets), "dropout": spec.dropout, "dtype": spec.compute_dtype(device)},
        feasible=False, adapter_params=adapter_params(model, spec).total)
    chosen = None
    for ranks, hosts in _layouts(per_host, device):
        found = fit(model, spec, ranks=ranks, hosts=hosts, budget=budget, device=device)
        if found.fits:
            chosen = found
            break
        record.rejected.append({"ranks": ranks, "hosts": hosts, "reason": found.reason,
                                "total": found.memory.total})
    record.notes = _notes(model, spec, device)
    if chosen is None:
        last = fit(model, spec, ranks=_layouts(per_host, device)[-1][0], hosts=MAX_HOSTS, budget=budget,
                   device=device).memory
        floor = last.quant_state + last.activations + last.buffers + last.runtime + last.allocator
        record.notes.append(f"no number of ranks fits: what sharding does not shrink (collective buffers "
                            f"{_gib(last.buffers)}, activations with checkpointing {_gib(last.activations)}, "
                            f"quant state {_gib(last.quant_state)}, runtime {_gib(last.runtime)}"
                            + (f", allocator {_gib(last.allocator)}" if last.allocator else "") + ") needs "
                            f"{_gib(floor)} of the {_gib(budget)} per-rank budget")
        return record
    memory = chosen.memory
    record.feasible = chosen.hosts <= len(profile.hosts)
    record.layout = {"ranks": chosen.ranks, "hosts": chosen.hosts, "ranks_per_host": min(chosen.ranks, per_host)}
    record.per_rank = {"base_shard": memory.base_shard, "quant_state": memory.quant_state,
                       "adapter": memory.adapter, "optimizer": memory.optimizer, "activations": memory.activations,
                       "activations_without_checkpointing": memory.activations_full,
                       "activations_with_checkpointing": memory.activations_checkpointed,
                       "buffers": memory.buffers, "runtime": memory.runtime, "allocator": memory.allocator,
                       "total": memory.total, "budget": budget}
    record.checkpointing = memory.checkpointing
    without = rank_memory(model, spec, chosen.ranks, device, checkpointing=False).total
    record.checkpointing_why = (
        f"on: without it the activations ({_gib(memory.activations_full)}) take the rank to {_gib(without)}, "
        f"over its {_gib(budget)} budget" if memory.checkpointing else
        f"off: everything fits without it ({_gib(memory.total)} of {_gib(budget)}); it would cost recomputing "
        "every layer's forward")
    if not record.feasible:
        record.notes.append(f"needs {chosen.hosts} hosts; the hardware here has {len(profile.hosts)}")
    return record


def _layouts(per_host: int, device: Device) -> list[tuple[int, int]]:
    """(ranks, hosts), smallest first."""
    if device == "cpu":
        return [(per_host * hosts, hosts) for hosts in range(1, MAX_HOSTS + 1)]
    return [(n, 1) for n in range(1, per_host + 1)] + [(per_host * h, h) for h in range(2, MAX_HOSTS + 1)]


def _hardware(profile: HardwareProfile, ranks_per_host: int | None) -> tuple[Device, int, int, str, int]:
    """The device, ranks a host, each rank's budget, the part's name and its memory."""
    if not profile.hosts:
        raise TrainPlanError("the hardware profile has no hosts")
    if any(host.gpus for host in profile.hosts):
        if ranks_per_host is not None:
            raise TrainPlanError("--processes is for CPU hosts; on GPU hosts every GPU trains one rank")
        counts = {len(host.gpus) for host in profile.hosts}
        if len(counts) > 1:
            raise TrainPlanError(f"hosts have different GPU counts ({sorted(len(h.gpus) for h in profile.hosts)}); "
                                 "size a training run on hosts alike", hint="give a subset of the hosts")
        smallest = min(gpu.memory_bytes for host in profile.hosts for gpu in host.gpus)
        names = " / ".join(sorted({gpu.name for host in profile.hosts for gpu in host.gpus}))
        return "cuda", counts.pop(), int(smallest * GPU_UTILIZATION), names, smallest
    per_host = 1 if ranks_per_host is None else ranks_per_host
    if per_host < 1:
        raise TrainPlanError(f"--processes {per_host}: must be at least 1")
    rams = [host.ram_bytes for host in profile.hosts]
    if any(not ram for ram in rams):
        raise TrainPlanError("a CPU host in the profile has no ram_bytes: a CPU rank's budget is its share of "
                             "the host's RAM", hint="profile the hosts with --detect, or add ram_bytes")
    ram = min(r for r in rams if r)
    return "cpu", per_host, cpu_rank_budget(ram, per_host), "CPU", ram


def cpu_rank_budget(ram_bytes: int, ranks_per_host: int) -> int:
    """A CPU rank's budget: the host's RAM divided among its ranks."""
    if ranks_per_host < 1:
        raise TrainPlanError(f"ranks per host {ranks_per_host}: must be at least 1")
    return ram_bytes // ranks_per_host


def _notes(model: ModelShape, spec: TrainSpec, device: Device) -> list[str]:
    dtype = spec.compute_dtype(device)
    notes = [f"compute dtype {dtype}{' (as the trainer loads the base on a CPU)' if device == 'cpu' else ''}; "
             f"adapters on {', '.join(_applicable(model, spec.targets))}; FSDP2 units: each decoder layer, the root "
             "(embeddings, final norm, lm_head) unsharded through the step; estimates, not measurements"]
    if model.quantization:
        notes.append(f"the checkpoint is stored as {model.quantization.get('quant_method', 'quantized')}; the "
                     f"base is trained from {'NF4' if spec.method == 'qlora' else 'bf16'} weights made from it")
    if model.experts is not None:
        notes.append("routed experts are sharded by FSDP over all ranks like any other parameter: a whole MoE "
                     "layer is all-gathered when it runs"
                     + ("" if "routed_experts" in spec.targets else "; they get no adapters (add routed_experts)"))
    return notes


def _applicable(model: ModelShape, targets: tuple[str, ...]) -> list[str]:
    """The targets this model has: a dense model has no experts, an all-MoE one no dense MLP."""
    present = {"attention": True, "mlp": bool(model.intermediate), "shared_experts": bool(
        model.experts and model.experts.shared), "routed_experts": model.experts is not None}
    return [t for t in targets if present[t]] or ["nothing this model has"]


def check_job(config: Path, *, method: Method, rank: int, seq_len: int, batch: int, ranks: int,
              rank_memory_bytes: int, device: Device, hosts: int = 1, targets: tuple[str, ...] = DEFAULT_TARGETS,
              dropout: float = 0.05, dtype: Dtype | None = None) -> TrainFit:
    """Whether a job fits before anything is loaded: the base's config.json (or its directory),
    the method, LoRA's rank, tokens per row, rows per micro-batch, the ranks in all over `hosts`
    and each rank's memory (a GPU's bytes, or on a CPU cpu_rank_budget(RAM, ranks per host));
    `dtype` the base's as the trainer holds it (None: bf16 on a GPU, fp32 on a CPU)."""
    model = load_model_config(config)
    spec = TrainSpec(method=method, rank=rank, seq_len=seq_len, batch=batch, targets=targets, dropout=dropout,
                     dtype=dtype)
    return fit(model, spec, ranks=ranks, hosts=hosts, budget=rank_memory_bytes, device=device)


def local_job_fit(shape: JobShape) -> JobFit:
    """The `appliance.job_fit` entry point: `shape` on this host (its profile, detected), each
    process's budget its GPU's memory (the smallest, less the allocator's margin) or its share of
    the host's RAM, and no more than the sandbox's limit. Both trainers hold the base in float32
    (a GPU's bf16 is autocast only), so that is the dtype sized."""
    host = local_host()
    if host.gpus:
        device: Device = "cuda"
        budget = int(min(gpu.memory_bytes for gpu in host.gpus) * GPU_UTILIZATION)
    else:
        if not host.ram_bytes:
            raise TrainPlanError("this host's RAM could not be read: a CPU process's budget is its share of it")
        device, budget = "cpu", cpu_rank_budget(host.ram_bytes, shape.processes)
    if shape.process_limit_bytes is not None:
        budget = min(budget, shape.process_limit_bytes)
    found = check_job(shape.base, method="qlora" if shape.qlora else "lora", rank=shape.rank, seq_len=shape.seq_len,
                      batch=shape.batch, ranks=shape.processes * shape.hosts if shape.sharded else 1,
                      hosts=shape.hosts if shape.sharded else 1, rank_memory_bytes=budget, device=device, dtype="fp32")
    return JobFit(checkpointing=found.memory.checkpointing, process_bytes=found.memory.total, budget_bytes=budget,
                  reason=found.reason)
