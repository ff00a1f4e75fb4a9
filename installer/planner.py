"""The parallelism planner: enumerate TP x PP x DP (x EP) layouts the hardware allows, reject
those that do not fit (the reason in numbers), rank the rest, and write the vLLM launch for
every host of the chosen one.

Rules: a TP group stays inside one host (NVLink domain); PP stages and DP replicas may span
hosts; a DP replica that would span hosts is not offered (vLLM's multi-node DP expects whole
replicas per node); EP only for MoE models, over TP x DP ranks that split the experts evenly;
TP must divide the attention heads, and the KV heads must divide TP or TP them. Ranking: fewest
GPUs that meet the target (a whole sequence of `context` tokens for each of `concurrency`
requests), then a throughput proxy that favours DP over PP and NVLink over PCIe for TP.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from appliance.engine_launch import PLAN_UTILIZATION, Rank, layout_of_plan, rank_command
from appliance.errors import ApplianceError
from appliance.gpus import choose_gpus, nvlink_domains
from appliance.home import Home
from appliance.records import (
    AlternativeLayout,
    HardwareProfile,
    Host,
    HostCommand,
    PerGpuBytes,
    Plan,
    PlanHardware,
    PlanLayout,
    PlanModel,
    PlanTarget,
    RejectedLayout,
    SmallestHardware,
)
from appliance.settings import EngineSettings, PoolSettings, Settings
from installer.memory import GIB, MAX_BATCHED_TOKENS, GpuMemory, Layout, count_params, gpu_memory, serving_format
from installer.model_config import ModelShape

UTILIZATION = PLAN_UTILIZATION  # vLLM's default --gpu-memory-utilization
MAX_HOSTS_SUGGESTED = 64


class PlanError(ApplianceError):
    """The request cannot be planned (bad pins, unusable hardware)."""


@dataclass(frozen=True)
class Pins:
    """Parts of the layout the operator fixed."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    ep: bool | None = None


@dataclass(frozen=True)
class LaunchSite:
    """Whose launch a plan prints: a pool (serving the plan's model), the engine settings and state
    dir it runs with. `appliance plan` passes the appliance's own; the defaults are placeholders."""

    pool: PoolSettings = field(default_factory=lambda: PoolSettings(name="main"))
    settings: Settings = field(default_factory=lambda: Settings(engine=EngineSettings(device="cuda")))
    home: Home = field(default_factory=lambda: Home(Path("$APPLIANCE_HOME")))


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: GpuMemory
    hosts: int
    reason: str | None  # why it is rejected; None when feasible
    score: float = 0.0


def plan(model: ModelShape, profile: HardwareProfile, *, context: int, concurrency: int,
         fmt: str | None = None, pins: Pins = Pins(), model_ref: str = "MODEL", site: LaunchSite | None = None) -> Plan:
    """The plan record: chosen layout, per-GPU memory, alternatives, rejections, commands."""
    weight_format = serving_format(model, fmt)
    gpus_per_host, gpu_bytes, nvlink, gpu_name = _homogeneous(profile)
    reach = min(max(map(len, nvlink_domains(host))) for host in profile.hosts)
    candidates = [_evaluate(model, layout, weight_format, gpus_per_host, gpu_bytes, nvlink, context, concurrency)
                  for layout in _layouts(model, gpus_per_host, len(profile.hosts), pins, reach)]
    feasible = _ranked(candidates)
    params = count_params(model)
    record = Plan(
        model=PlanModel(name=model.name, config_sha256=model.config_sha256, architecture=model.architecture,
                        total_params=params.total, active_params=params.active, format=weight_format,
                        layers=model.layers, quantization=_quantization(model, weight_format)),
        hardware=PlanHardware(hosts=len(profile.hosts), gpus_per_host=gpus_per_host, gpu=gpu_name,
                              gpu_memory_bytes=gpu_bytes, nvlink=nvlink),
        target=PlanTarget(context=context, concurrency=concurrency),
        feasible=bool(feasible),
        rejected=[RejectedLayout(layout=_layout_record(c), reason=c.reason) for c in candidates
                  if c.reason is not None and c.layout.dp == 1])
    if not feasible:
        record.smallest_fitting_hardware = _smallest_hardware(
            model, weight_format, gpus_per_host, gpu_bytes, nvlink, gpu_name, context, concurrency, pins,
            start=len(profile.hosts) + 1, reach=reach)
        return record
    best = feasible[0]
    memory = best.memory
    record.layout = _layout_record(best)
    record.per_gpu = PerGpuBytes(weights=memory.weights, kv_cache=memory.kv_cache, reserve=memory.reserve,
                                 budget=memory.budget)
    record.kv_bytes_per_token = memory.kv_bytes_per_token
    record.kv_capacity_tokens = memory.kv_capacity_tokens * best.layout.dp
    record.max_concurrent_sequences = memory.kv_capacity_tokens // context * best.layout.dp
    record.alternatives = [AlternativeLayout(layout=_layout_record(c),
                                             kv_capacity_tokens=c.memory.kv_capacity_tokens * c.layout.dp)
                           for c in feasible[1:6]]
    record.commands = commands(record, profile.hosts, model_ref, site or LaunchSite())
    record.notes = [f"weights as {weight_format}; KV cache in bf16; reserves are estimates (activation peak "
                    f"of a {MAX_BATCHED_TOKENS}-token prefill step, 1 GiB non-torch, 1 GiB CUDA graphs)"]
    if best.layout.tp > gpus_per_host:
        record.notes.append(f"TP {best.layout.tp} spans {best.hosts} hosts (pinned): every layer all-reduces over the "
                            "network; only worth it with InfiniBand or RoCE between them")
    return record


def _ranked(candidates: list[Candidate]) -> list[Candidate]:
    """Feasible candidates, best first: fewest GPUs, then the throughput proxy."""
    return sorted((c for c in candidates if c.reason is None), key=lambda c: (c.layout.gpus, -c.score))


def _homogeneous(profile: HardwareProfile) -> tuple[int, int, bool, str]:
    """GPUs per host, the smallest GPU's bytes, NVLink inside every host, the GPU name."""
    hosts_with_gpus = [h for h in profile.hosts if h.gpus]
    if not hosts_with_gpus:
        raise PlanError("the profile has no GPUs", hint="plan with --hardware, e.g. 1x8xH100-80GB, or --profile")
    counts = {len(h.gpus) for h in hosts_with_gpus}
    if len(counts) > 1 or len(hosts_with_gpus) < len(profile.hosts):
        raise PlanError(f"hosts have different GPU counts ({sorted(len(h.gpus) for h in profile.hosts)}); "
                        "the planner needs the same number on every host", hint="plan a subset of the hosts")
    names = {g.name for h in hosts_with_gpus for g in h.gpus}
    return (counts.pop(), min(g.memory_bytes for h in hosts_with_gpus for g in h.gpus),
            all(_nvlinked(h) for h in hosts_with_gpus), " / ".join(sorted(names)))


def _nvlinked(host: Host) -> bool:
    return len(host.gpus) == 1 or host.nvlink_all_to_all


def _layouts(model: ModelShape, gpus_per_host: int, hosts: int, pins: Pins,
             nvlink_reach: int) -> Iterator[Layout]:
    """Every layout the hardware and the model allow, honouring the pins. A TP group must fit in
    `nvlink_reach` GPUs (the smallest host's largest NVLink domain)."""
    total = gpus_per_host * hosts
    tps = [t for t in _powers_of_two(gpus_per_host) if _tp_divides(model, t) and t <= nvlink_reach]
    # TP over whole hosts is offered only when pinned: its all-reduce crosses the network every layer.
    across_hosts = (pins.tp is not None and pins.tp > gpus_per_host and pins.tp % gpus_per_host == 0
                    and pins.tp <= total and gpus_per_host <= nvlink_reach and _tp_divides(model, pins.tp)
                    and pins.tp & (pins.tp - 1) == 0)
    if pins.tp is not None:
        if pins.tp not in tps and not across_hosts:
            raise PlanError(f"--tp {pins.tp} is not possible: TP must be a power of two up to the {nvlink_reach} "
                            f"GPUs of one NVLink domain (or whole hosts) and fit the model's heads "
                            f"({model.heads} attention, {model.kv_heads} KV)", hint=f"possible: {tps}")
        tps = [pins.tp]
    if pins.pp is not None and not 1 <= pins.pp <= model.layers:
        raise PlanError(f"--pp {pins.pp} is not possible: the model has {model.layers} layers")
    if pins.ep and not model.is_moe:
        raise PlanError(f"--ep: {model.name} has no experts to spread")
    eps = [pins.ep] if pins.ep is not None else ([False, True] if model.is_moe else [False])
    for tp in tps:
        for pp in [pins.pp] if pins.pp else range(1, min(model.layers, total // tp) + 1):
            replica = tp * pp
            for dp in [pins.dp] if pins.dp else range(1, total // replica + 1):
                gpus = replica * dp
                if gpus > total or (gpus > gpus_per_host and gpus % gpus_per_host):
                    continue  # not whole hosts
                if dp > 1 and replica > gpus_per_host:
                    continue  # a replica spanning hosts
                if pp > 1 and tp > gpus_per_host:
                    continue  # TP over hosts and PP together: not offered
                for ep in eps:
                    if ep and model.experts is not None and model.experts.routed % (tp * dp):
                        continue  # experts must split evenly over the EP ranks (TP x DP)
                    yield Layout(tp=tp, pp=pp, dp=dp, ep=ep)


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


def _tp_divides(model: ModelShape, tp: int) -> bool:
    if model.heads % tp:
        return False
    return model.mla is not None or model.kv_heads % tp == 0 or tp % model.kv_heads == 0


def _evaluate(model: ModelShape, layout: Layout, fmt: str, gpus_per_host: int, gpu_bytes: int, nvlink: bool,
              context: int, concurrency: int) -> Candidate:
    memory = gpu_memory(model, layout, fmt, gpu_bytes, UTILIZATION)
    hosts = math.ceil(layout.gpus / gpus_per_host)
    need = memory.weights + memory.reserve
    if need > memory.budget:
        reason = (f"weights {_gib(memory.weights)} + reserve {_gib(memory.reserve)} per GPU exceed the "
                  f"{_gib(memory.budget)} budget ({UTILIZATION:.0%} of {_gib(gpu_bytes)})")
        return Candidate(layout, memory, hosts, reason)
    per_replica = math.ceil(concurrency / layout.dp)
    if memory.kv_capacity_tokens < context * per_replica:
        reason = (f"KV cache {_gib(memory.kv_cache)} per GPU holds {memory.kv_capacity_tokens:,} tokens "
                  f"({memory.kv_bytes_per_token:,} B/token); {per_replica} x {context:,}-token sequences "
                  f"need {context * per_replica:,}")
        return Candidate(layout, memory, hosts, reason)
    tp_speed = 1.0 if (layout.tp == 1 or nvlink) else 0.6
    score = layout.dp * tp_speed / (1 + 0.15 * (layout.pp - 1)) + memory.kv_capacity_tokens * 1e-12
    return Candidate(layout, memory, hosts, None, score)


def _smallest_hardware(model: ModelShape, fmt: str, gpus_per_host: int, gpu_bytes: int, nvlink: bool,
                       gpu_name: str, context: int, concurrency: int, pins: Pins,
                       start: int, reach: int) -> SmallestHardware | None:
    """The fewest hosts like these on which some layout fits."""
    for hosts in range(start, MAX_HOSTS_SUGGESTED + 1):
        fitting = _ranked([_evaluate(model, layout, fmt, gpus_per_host, gpu_bytes, nvlink, context, concurrency)
                           for layout in _layouts(model, gpus_per_host, hosts, pins, reach)])
        if fitting:
            return SmallestHardware(hosts=hosts, gpus_per_host=gpus_per_host, gpu=gpu_name,
                                    layout=_layout_record(fitting[0]))
    return None


def _layout_record(candidate: Candidate) -> PlanLayout:
    layout = candidate.layout
    return PlanLayout(tp=layout.tp, pp=layout.pp, dp=layout.dp, ep=layout.ep, gpus=layout.gpus,
                      hosts=candidate.hosts)


def _gib(value: int) -> str:
    return f"{value / GIB:.1f} GiB"


def _quantization(model: ModelShape, fmt: str) -> str | None:
    if fmt == serving_format(model, None):
        return None
    return "bitsandbytes" if fmt == "nf4" else fmt


def commands(record: Plan, profile_hosts: list[Host], model_ref: str, site: LaunchSite) -> list[HostCommand]:
    """Each host's launch, built by the engine launcher's own function (appliance.engine_launch),
    with its GPUs chosen from the profile: TP groups inside an NVLink domain and one NUMA node."""
    pool_layout = layout_of_plan(record, "the plan")
    chosen = [(host, choose_gpus(host, host.gpus, pool_layout.gpus_per_host, pool_layout.local_tp))
              for host in profile_hosts[:pool_layout.hosts]]
    for host, gpus in chosen:
        if gpus is None:
            raise PlanError(f"{host.name}: its GPUs do not make {pool_layout.gpus_per_host // pool_layout.tp} TP "
                            f"groups of {pool_layout.tp} inside NVLink domains",
                            hint="pin a smaller --tp, or check the profile's nvlink_peers")
    head = chosen[0][0].name
    pool = site.pool.model_copy(update={"model": model_ref, "plan": None})
    return [rank_command(pool, site.settings, site.home, pool_layout, "cuda",
                         Rank(node=node, head=head, gpus=gpus or ()), host=host.name)
            for node, (host, gpus) in enumerate(chosen)]
