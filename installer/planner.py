"""The parallelism planner: consider every TP x PP x DP (x EP) layout on part of one host or on
whole hosts, reject each one a rule or the memory rules out (the reason in numbers), choose among
the rest by a stated objective, and write the vLLM launch for every host of the chosen one.

The rules (vLLM's and the launch's) are installer/layout_rules.py; the memory, installer/memory.py.

Objectives, among the layouts that fit `concurrency` sequences of `context` tokens:
- capacity (the default): the most KV-cache tokens in all (and so sequences at that context),
  then fewer hosts, then less traffic between hosts;
- min-gpus: the fewest GPUs, then a throughput proxy that favours DP over PP and NVLink for TP.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

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
from installer.layout_rules import Site, heads_split, rule_out
from installer.memory import (
    GIB,
    MAX_BATCHED_TOKENS,
    NO_SPECULATION,
    GpuMemory,
    Layout,
    Speculative,
    count_params,
    gpu_memory,
    serving_format,
)
from installer.model_config import ModelShape, load_model_config

UTILIZATION = PLAN_UTILIZATION  # vLLM's default --gpu-memory-utilization
MAX_HOSTS_SUGGESTED = 64
MAX_SPECULATIVE_TOKENS = 64  # as SpeculativeConfig allows
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
Objective = Literal["capacity", "min-gpus"]
OBJECTIVES: tuple[Objective, ...] = ("capacity", "min-gpus")


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
    memory: GpuMemory | None  # None: a rule ruled it out before its memory was worked out
    hosts: int
    reason: str | None  # why it is rejected; None when feasible
    score: float = 0.0
    crossing: int = 0  # how much traffic crosses hosts: 0 none ... 3 TP's all-reduce every layer

    @property
    def kv_tokens(self) -> int:
        """KV-cache tokens in all: each replica's."""
        return self.memory.kv_capacity_tokens * self.layout.dp if self.memory else 0


def plan(model: ModelShape, profile: HardwareProfile, *, context: int, concurrency: int,
         fmt: str | None = None, pins: Pins = Pins(), model_ref: str = "MODEL", site: LaunchSite | None = None,
         objective: Objective = "capacity", speculative: Speculative = NO_SPECULATION,
         reserved: Mapping[str, Sequence[int]] | None = None) -> Plan:
    """The plan record: chosen layout, per-GPU memory, alternatives, rejections, commands. GPUs
    `reserved` for other pools (by pool name: their indexes on each host) are left out."""
    if context < 1 or concurrency < 1:
        raise PlanError(f"context {context} and concurrency {concurrency}: each must be at least 1")
    if objective not in OBJECTIVES:
        raise PlanError(f"objective {objective!r}: not one of {', '.join(OBJECTIVES)}")
    profile, held = _without(profile, reserved or {})
    weight_format = serving_format(model, fmt)
    gpus_per_host, gpu_bytes, nvlink, gpu_name = _homogeneous(profile)
    reach = min(max(map(len, nvlink_domains(host))) for host in profile.hosts)
    fit = _Fit(model, weight_format, gpus_per_host, gpu_bytes, nvlink, context, concurrency, speculative)
    candidates = [fit.evaluate(layout) if reason is None
                  else Candidate(layout, None, math.ceil(layout.gpus / gpus_per_host), reason)
                  for layout, reason in _layouts(model, gpus_per_host, len(profile.hosts), pins, reach, speculative)]
    feasible = _ranked(candidates, objective)
    params = count_params(model)
    record = Plan(
        model=PlanModel(name=model.name, config_sha256=model.config_sha256, architecture=model.architecture,
                        total_params=params.total, active_params=params.active, format=weight_format,
                        layers=model.layers, quantization=_quantization(model, weight_format)),
        hardware=PlanHardware(hosts=len(profile.hosts), gpus_per_host=gpus_per_host, gpu=gpu_name,
                              gpu_memory_bytes=gpu_bytes, nvlink=nvlink),
        target=PlanTarget(context=context, concurrency=concurrency, speculative=speculative.vllm_config()),
        feasible=bool(feasible), objective=objective,
        rejected=[RejectedLayout(layout=_layout_record(c), reason=c.reason) for c in candidates
                  if c.reason is not None])
    if not feasible:
        _explain_no_fit(record, fit, pins, hosts=len(profile.hosts), reach=reach, considered=bool(candidates))
        return record
    best = feasible[0]
    memory = best.memory
    assert memory is not None  # a feasible layout's memory was worked out
    record.layout = _layout_record(best)
    record.per_gpu = PerGpuBytes(weights=memory.weights, kv_cache=memory.kv_cache, reserve=memory.reserve,
                                 budget=memory.budget)
    record.kv_bytes_per_token = memory.kv_bytes_per_token
    record.kv_capacity_tokens = memory.kv_capacity_tokens * best.layout.dp
    record.max_concurrent_sequences = memory.kv_capacity_tokens // context * best.layout.dp
    record.alternatives = [AlternativeLayout(layout=_layout_record(c), kv_capacity_tokens=c.kv_tokens)
                           for c in feasible[1:]]
    record.choice = _why_chosen(best, feasible[1] if len(feasible) > 1 else None, objective, context)
    record.runner_up = record.alternatives[0] if record.alternatives else None
    record.commands = commands(record, profile.hosts, model_ref, site or LaunchSite())
    record.notes = [f"weights as {weight_format}; KV cache in bf16; reserves are estimates (activation peak "
                    f"of a {MAX_BATCHED_TOKENS}-token prefill step, 1 GiB non-torch, 1 GiB CUDA graphs)", *held]
    if (asked := speculative.vllm_config()) is not None:
        extra = speculative.weight_bytes(model, best.layout, weight_format)
        record.notes.append(f"speculative decoding ({asked.method}, {speculative.tokens} token(s) a step): "
                            f"{_gib(extra)} of weights and {speculative.kv_bytes_per_token(model, best.layout):,} "
                            "KV bytes/token more on the last pipeline stage, counted on the fullest")
    if best.layout.tp > gpus_per_host:
        record.notes.append(f"TP {best.layout.tp} spans {best.hosts} hosts (pinned): every layer all-reduces over the "
                            "network; only worth it with InfiniBand or RoCE between them")
    return record


def _explain_no_fit(record: Plan, fit: _Fit, pins: Pins, *, hosts: int, reach: int, considered: bool) -> None:
    """The smallest hardware that fits, and what would fit there, rejected here for the host boundary
    with its numbers; an error when the pins leave no layout to consider up to MAX_HOSTS_SUGGESTED."""
    smallest = _smallest_hardware(fit, pins, start=hosts + 1, reach=reach, objective=record.objective)
    if smallest is None:
        if not considered:
            pinned = " ".join(("--ep" if value else "--no-ep") if name == "ep" else f"--{name} {value}"
                              for name, value in vars(pins).items() if value is not None)
            raise PlanError(f"no layout meets the pins ({pinned}) on {hosts} to {MAX_HOSTS_SUGGESTED} hosts of "
                            f"{fit.gpus_per_host} GPUs", hint="pin less, or pin sizes the GPUs divide into")
        return
    needed, fitting = smallest
    record.smallest_fitting_hardware = SmallestHardware(hosts=needed, gpus_per_host=fit.gpus_per_host,
                                                        gpu=record.hardware.gpu, layout=_layout_record(fitting[0]))
    have = f"{hosts} host(s) of {fit.gpus_per_host} GPUs here"
    record.rejected += [RejectedLayout(layout=_layout_record(c), reason=(
        f"needs {c.layout.gpus} GPUs on {c.hosts} hosts ({have}); there it holds {c.kv_tokens:,} KV tokens, "
        f"{c.kv_tokens // fit.context} sequences of {fit.context:,}")) for c in fitting]


def _without(profile: HardwareProfile, reserved: Mapping[str, Sequence[int]]) -> tuple[HardwareProfile, list[str]]:
    """The profile less the GPUs other pools hold (`pools.<name>.gpus`), and a note for each pool."""
    taken = {index for indexes in reserved.values() for index in indexes}
    if not taken:
        return profile, []
    hosts = [host.model_copy(update={"gpus": [g for g in host.gpus if g.index not in taken]}) for host in profile.hosts]
    if not any(host.gpus for host in hosts):
        raise PlanError(f"every GPU is held by other pools ({', '.join(sorted(reserved))}: pools.<name>.gpus)",
                        hint="free some in the settings, or plan for one of those pools")
    notes = [f"GPUs {', '.join(map(str, sorted(indexes)))} of each host left out: pool {name} holds them "
             f"(pools.{name}.gpus)" for name, indexes in sorted(reserved.items()) if indexes]
    return profile.model_copy(update={"hosts": hosts}), notes


def speculation(model: ModelShape, method: str | None, tokens: int = 1) -> Speculative:
    """What `--speculative` asks for: None, 'mtp' (the model's own multi-token-prediction layers),
    or a draft model's checkpoint directory or config.json."""
    if method is None:
        if tokens != 1:
            raise PlanError(f"--speculative-tokens {tokens}: give --speculative too (mtp, or a draft model)")
        return NO_SPECULATION
    if not 1 <= tokens <= MAX_SPECULATIVE_TOKENS:
        raise PlanError(f"--speculative-tokens {tokens}: must be between 1 and {MAX_SPECULATIVE_TOKENS}")
    if method == "mtp":
        layers = model.mtp_layers
        if not layers:
            raise PlanError(f"--speculative mtp: {model.name} has no multi-token-prediction layers "
                            "(num_nextn_predict_layers is 0 or absent)", hint="give a draft model's directory instead")
        # config/speculative.py: "num_speculative_tokens ... must be divisible by n_predict"
        if tokens > layers and tokens % layers:
            raise PlanError(f"--speculative-tokens {tokens}: must be at most {layers} or a multiple of it "
                            f"(the model's {layers} MTP layers)")
        return Speculative(mtp=True, tokens=tokens)
    if not method or CONTROL.search(method) or not method.isprintable():
        raise PlanError(f"--speculative {method[:80]!r}: give 'mtp' or a draft model's directory (a path without "
                        "control characters)")
    try:
        method.encode()
    except UnicodeEncodeError:
        raise PlanError(f"--speculative {method[:80]!r}: not a path this system can name") from None
    given = Path(method)
    draft = load_model_config(given)
    # vLLM loads the draft from its directory, wherever the engine's working directory is.
    directory = (given if given.is_dir() else given.parent).resolve()
    return Speculative(draft=draft, draft_format=serving_format(draft, None), draft_ref=str(directory), tokens=tokens)


def _ranked(candidates: list[Candidate], objective: Objective) -> list[Candidate]:
    """Feasible candidates, best first by the objective."""
    feasible = [c for c in candidates if c.reason is None]
    if objective == "min-gpus":
        return sorted(feasible, key=lambda c: (c.layout.gpus, -c.score))
    return sorted(feasible, key=lambda c: (-c.kv_tokens, c.hosts, c.crossing, -c.score))


def _why_chosen(best: Candidate, runner_up: Candidate | None, objective: Objective, context: int) -> str:
    """The objective's numbers for the chosen layout and, if there is one, the runner-up's."""
    if objective == "min-gpus":
        chosen = f"min-gpus: {best.layout} uses {best.layout.gpus} GPUs"
        if runner_up is None:
            return chosen + "; no other layout fits"
        return (chosen + f"; the runner-up {runner_up.layout} uses {runner_up.layout.gpus}"
                + ("" if runner_up.layout.gpus > best.layout.gpus else
                   f" (same count: {best.layout} has the better throughput proxy, {best.score:.2f} vs "
                   f"{runner_up.score:.2f})"))
    chosen = (f"capacity: {best.layout} holds {best.kv_tokens:,} KV tokens "
              f"({best.kv_tokens // context} sequences of {context:,})")
    if runner_up is None:
        return chosen + "; no other layout fits"
    if runner_up.kv_tokens < best.kv_tokens:
        lead = f"{best.kv_tokens / runner_up.kv_tokens:.2f}x" if runner_up.kv_tokens else "more than"
        return chosen + f", {lead} the runner-up {runner_up.layout} ({runner_up.kv_tokens:,})"
    tie = ("fewer hosts" if best.hosts < runner_up.hosts else "less traffic between hosts"
           if best.crossing < runner_up.crossing else "the better throughput proxy")
    return chosen + f", as many as the runner-up {runner_up.layout}, which loses on {tie}"


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


def _layouts(model: ModelShape, gpus_per_host: int, hosts: int, pins: Pins, nvlink_reach: int,
             speculative: Speculative, more_than: int = 0) -> Iterator[tuple[Layout, str | None]]:
    """Every layout on part of one host or on whole hosts (of more than `more_than` GPUs), honouring
    the pins, each with the rule that rules it out (None: the memory decides). A TP group must fit
    in `nvlink_reach` GPUs (the smallest host's largest NVLink domain)."""
    total = gpus_per_host * hosts
    tps = _powers_of_two(gpus_per_host)
    # TP over whole hosts is offered only when pinned: its all-reduce crosses the network every layer.
    across_hosts = (pins.tp is not None and pins.tp > gpus_per_host and pins.tp % gpus_per_host == 0
                    and pins.tp <= total and gpus_per_host <= nvlink_reach and heads_split(model, pins.tp) is None
                    and pins.tp & (pins.tp - 1) == 0)
    if pins.tp is not None:
        possible = [t for t in tps if heads_split(model, t) is None and t <= nvlink_reach]
        if pins.tp not in possible and not across_hosts:
            raise PlanError(f"--tp {pins.tp} is not possible: TP must be a power of two up to the {nvlink_reach} "
                            f"GPUs of one NVLink domain (or whole hosts) and fit the model's heads "
                            f"({model.heads} attention, {model.kv_heads} KV)", hint=f"possible: {possible}")
        tps = [pins.tp]
    if pins.pp is not None and not 1 <= pins.pp <= model.layers:
        raise PlanError(f"--pp {pins.pp} is not possible: the model has {model.layers} layers")
    if pins.ep and not model.is_moe:
        raise PlanError(f"--ep: {model.name} has no experts to spread")
    eps = [pins.ep] if pins.ep is not None else ([False, True] if model.is_moe else [False])
    site = Site(gpus_per_host, nvlink_reach, speculative)
    for tp in tps:
        for pp in [pins.pp] if pins.pp else range(1, min(model.layers, total // tp) + 1):
            replica = tp * pp
            for dp in [pins.dp] if pins.dp else range(1, total // replica + 1):
                gpus = replica * dp
                if gpus > total or gpus <= more_than or (gpus > gpus_per_host and gpus % gpus_per_host):
                    continue  # not whole hosts: not considered
                for ep in eps:
                    layout = Layout(tp=tp, pp=pp, dp=dp, ep=ep)
                    yield layout, rule_out(model, layout, site)


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


@dataclass(frozen=True)
class _Fit:
    """Whether a layout fits: the model, its weight format, the GPUs, and the target."""

    model: ModelShape
    fmt: str
    gpus_per_host: int
    gpu_bytes: int
    nvlink: bool
    context: int
    concurrency: int
    speculative: Speculative

    def evaluate(self, layout: Layout) -> Candidate:
        memory = gpu_memory(self.model, layout, self.fmt, self.gpu_bytes, UTILIZATION, speculative=self.speculative)
        hosts = math.ceil(layout.gpus / self.gpus_per_host)
        need = memory.weights + memory.reserve
        if need > memory.budget:
            reason = (f"weights {_gib(memory.weights)} + reserve {_gib(memory.reserve)} per GPU exceed the "
                      f"{_gib(memory.budget)} budget ({UTILIZATION:.0%} of {_gib(self.gpu_bytes)})")
            return Candidate(layout, memory, hosts, reason)
        per_replica = -(-self.concurrency // layout.dp)  # integers: any concurrency
        if memory.kv_capacity_tokens < self.context * per_replica:
            reason = (f"KV cache {_gib(memory.kv_cache)} per GPU holds {memory.kv_capacity_tokens:,} tokens "
                      f"({memory.kv_bytes_per_token:,} B/token); {per_replica} x {self.context:,}-token sequences "
                      f"need {self.context * per_replica:,}")
            return Candidate(layout, memory, hosts, reason)
        tp_speed = 1.0 if (layout.tp == 1 or self.nvlink) else 0.6
        # Across TP x DP ranks, EP sends each token to its experts' ranks only; without it every rank
        # computes a slice of every expert and all of them all-reduce each MoE layer.
        ep_speed = 1.1 if layout.ep else 1.0
        score = (layout.dp * tp_speed * ep_speed / (1 + 0.15 * (layout.pp - 1))
                 + memory.kv_capacity_tokens * 1e-12)
        return Candidate(layout, memory, hosts, None, score, _crossing(layout, self.gpus_per_host))


def _crossing(layout: Layout, gpus_per_host: int) -> int:
    """What crosses hosts: 0 nothing (one host, or DP replicas that only share the load), 1 PP's
    activations between stages, 2 EP's all-to-all over replicas, 3 TP's all-reduce every layer."""
    if layout.gpus <= gpus_per_host:
        return 0
    if layout.tp > gpus_per_host:
        return 3
    if layout.ep and layout.dp > 1:
        return 2
    return 1 if layout.pp * layout.tp > gpus_per_host else 0


def _smallest_hardware(fit: _Fit, pins: Pins, start: int, reach: int,
                       objective: Objective) -> tuple[int, list[Candidate]] | None:
    """The fewest hosts like these on which some layout fits, and the layouts that fit there (best
    first) and need every one of them (those on fewer hosts did not fit)."""
    for hosts in range(start, MAX_HOSTS_SUGGESTED + 1):
        space = _layouts(fit.model, fit.gpus_per_host, hosts, pins, reach, fit.speculative,
                         more_than=(hosts - 1) * fit.gpus_per_host)
        fitting = _ranked([fit.evaluate(layout) for layout, reason in space if reason is None], objective)
        if fitting:
            return hosts, fitting
    return None


def _layout_record(candidate: Candidate) -> PlanLayout:
    layout = candidate.layout
    return PlanLayout(tp=layout.tp, pp=layout.pp, dp=layout.dp, ep=layout.ep, gpus=layout.gpus,
                      hosts=candidate.hosts)


def _gib(value: int) -> str:
    return f"{value / GIB:.1f} GiB"


def _quantization(model: ModelShape, fmt: str) -> str | None:
    """vLLM's --quantization for serving the checkpoint as `fmt`; None for its own format or a
    16-bit float one (that is --dtype, which the launch sets: bfloat16 on a GPU unless engine.dtype)."""
    if fmt == serving_format(model, None) or fmt in ("bf16", "fp16", "fp32"):
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
