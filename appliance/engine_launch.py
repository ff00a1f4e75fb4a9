"""Every rank's vLLM launch, built in one place: the engine launcher runs what `rank_command`
returns and `appliance plan` prints it, for the head (the OpenAI server on its Unix socket) and for
headless ranks on other hosts alike.

Each rank runs `python -P -m serve.vllm_rank ARGS`: vLLM's own `serve` command through its own
argument parser, which both the CPU and the CUDA build provide (the CPU build's `vllm` console
script fails on its package metadata). `-P` keeps the working directory (the state dir, whose
audit/ folder would shadow the audit package) off sys.path.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from appliance.engine_build import driver_loaded, installed_engine
from appliance.errors import SettingsError
from appliance.home import Home
from appliance.model_refs import model_dir, served_name
from appliance.programs import OFFLINE_ENVIRONMENT
from appliance.records import HostCommand, Plan, load_plan
from appliance.settings import EngineSettings, PoolSettings, Settings
from appliance.tool_calling import tool_calling

RANK_MODULE = "serve.vllm_rank"
DP_RPC_PORT = 13345
MASTER_PORT = 29501
PLAN_UTILIZATION = 0.9  # the planner's memory model assumes vLLM's default


@dataclass(frozen=True)
class PoolLayout:
    """A pool's parallel layout and context length, over `hosts` hosts."""

    tp: int
    pp: int
    dp: int
    ep: bool
    max_model_len: int
    hosts: int = 1
    quantization: str | None = None
    speculative: str | None = None  # vLLM --speculative-config, JSON

    @property
    def gpus_per_host(self) -> int:
        return self.tp * self.pp * self.dp // self.hosts

    @property
    def local_tp(self) -> int:
        """The part of a TP group on one host (all of it, unless TP spans hosts)."""
        return min(self.tp, self.gpus_per_host)


@dataclass(frozen=True)
class Rank:
    """One host's part of a pool: its node rank, the head's address, its GPUs there; across hosts
    also its own address and interface on the cluster network (vLLM and gloo/NCCL bind to them),
    and the interpreter it runs (the host's own)."""

    node: int = 0
    head: str = "127.0.0.1"
    gpus: tuple[int, ...] = field(default_factory=tuple)
    address: str | None = None
    interface: str | None = None
    python: str | None = None
    replica: str | None = None  # which of the pool's engines (its socket's name); unset: the pool's first


def python() -> str:
    """This environment's interpreter by one name, whichever alias (python, python3.11) started us:
    the plan printed by the CLI and the launch run by `up` then match to the byte."""
    venv_python = Path(sys.prefix) / "bin" / "python"
    return str(venv_python) if sys.prefix != sys.base_prefix and venv_python.exists() else sys.executable


def engine_program(engine: str) -> str:
    """The supervised program that runs an engine's ranks on a host (the head's or a worker's): a
    pool's, or one of its replicas' (`replica_names`)."""
    return f"vllm-{engine}"


def replica_names(pool: PoolSettings) -> list[str]:
    """The engines of a pool: its own name for the first (a pool of one keeps the name it always had),
    then <name>_1, <name>_2, ... ('_' is never in a pool's name, so no two pools' replicas clash)."""
    return [pool.name, *(f"{pool.name}_{index}" for index in range(1, pool.replicas))]


def chat_template_file(home: Home, engine: str) -> Path:
    """The chat template an engine serves with, where the appliance gives it one (appliance.tool_calling)."""
    return home.run / "engines" / f"{engine}.chat-template.jinja"


def engine_socket(home: Home, engine: str) -> Path:
    """The Unix socket an engine (a pool's, or one of its replicas') listens on, in the state dir's
    private (0700) run/engines/."""
    return home.run / "engines" / f"{engine}.sock"


def resolve_device(engine: EngineSettings) -> str:
    """'cuda' or 'cpu': the setting; else (auto) the installed engine build's, or, with no engine
    installed, whether an NVIDIA driver is loaded."""
    if engine.device != "auto":
        return engine.device
    return installed_engine() or ("cuda" if driver_loaded() else "cpu")


def resolve_dtype(engine: EngineSettings, device: str) -> str:
    """vLLM's --dtype: the setting, or bfloat16 on cuda and float32 on cpu (vLLM's CPU bfloat16
    kernels changed the demo model's greedy answers on AMX hosts)."""
    return engine.dtype or ("float32" if device == "cpu" else "bfloat16")


def layout_of_plan(plan: Plan, where: str) -> PoolLayout:
    if plan.layout is None:
        raise SettingsError(f"{where}: the plan found no feasible layout", hint="plan again with more hardware")
    layout = plan.layout
    speculative = plan.target.speculative.model_dump_json(exclude_none=True) if plan.target.speculative else None
    return PoolLayout(layout.tp, layout.pp, layout.dp, layout.ep, plan.target.context, layout.hosts,
                      plan.model.quantization, speculative)


def pool_plan(pool: PoolSettings) -> tuple[Plan, str] | None:
    """The plan record a pool names, with where it came from for errors; None if it names none."""
    if pool.plan is None:
        return None
    path = Path(pool.plan).expanduser()
    where = f"pools.{pool.name}.plan: {path}"
    return load_plan(path, where, SettingsError), where


def pool_layout(pool: PoolSettings, engine: EngineSettings) -> PoolLayout:
    """The pool's parallel layout and context length: from its plan file if it names one."""
    planned = pool_plan(pool)
    if planned is None:
        return PoolLayout(pool.tensor_parallel_size, pool.pipeline_parallel_size, pool.data_parallel_size,
                          pool.enable_expert_parallel, pool.max_model_len or engine.max_model_len)
    return layout_of_plan(*planned)


MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")  # config.json's names for routed experts


def serves_adapters(pool: PoolSettings, settings: Settings, home: Home) -> bool:
    """Whether the pool's engines serve LoRA adapters: `pools.NAME.enable_lora`, or where it is unset
    on, but for a mixture-of-experts model on the CPU engine (vLLM's fused-MoE LoRA needs Triton's GPU
    kernels: the engine starts, then dies on its first request)."""
    if pool.enable_lora is not None:
        return pool.enable_lora
    return not (resolve_device(settings.engine) == "cpu" and _mixture_of_experts(model_dir(pool, home)))


def _mixture_of_experts(directory: Path) -> bool:
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return False  # the engine's own start says what is wrong with the model
    parts = [config, config.get("text_config") or {}] if isinstance(config, dict) else []
    return any(isinstance(part, dict) and (part.get(field) or 0) > 1 for part in parts for field in MOE_FIELDS)


def rank_command(pool: PoolSettings, settings: Settings, home: Home, layout: PoolLayout, device: str,
                 rank: Rank, host: str = "localhost") -> HostCommand:
    """The argv and environment (no secrets: the launcher adds the engine's key) of one host's
    ranks of `pool`."""
    engine = settings.engine
    on_cpu = device == "cpu"
    utilization = engine.gpu_memory_utilization or (0.3 if on_cpu else PLAN_UTILIZATION)
    eager = engine.enforce_eager if engine.enforce_eager is not None else on_cpu
    argv = [
        rank.python or python(), "-P", "-m", RANK_MODULE,
        "--model", str(model_dir(pool, home)),
        "--served-model-name", served_name(pool, home),
        "--dtype", resolve_dtype(engine, device),
        "--max-model-len", str(layout.max_model_len),
        "--gpu-memory-utilization", str(utilization),
        "--tensor-parallel-size", str(layout.tp),
        "--pipeline-parallel-size", str(layout.pp),
        "--data-parallel-size", str(layout.dp),
    ]
    argv += _across_hosts(layout, rank)
    if rank.node == 0:
        argv += ["--uds", str(engine_socket(home, rank.replica or pool.name)), "--disable-uvicorn-access-log"]
    if eager:
        argv.append("--enforce-eager")
    if layout.ep:
        argv.append("--enable-expert-parallel")
    if layout.quantization:
        argv += ["--quantization", layout.quantization]
    if layout.speculative:
        argv += ["--speculative-config", layout.speculative]
    lora = serves_adapters(pool, settings, home)
    if lora:
        argv += ["--enable-lora", "--max-lora-rank", str(pool.max_lora_rank), "--max-loras", str(pool.max_loras)]
    if rank.node == 0 and (tools := tool_calling(model_dir(pool, home), pool.tool_parser)) is not None:
        argv += tools.args(chat_template_file(home, rank.replica or pool.name))  # the head serves the API
    argv += pool.extra_args

    # The engine's log is the operator's record of its start and loader: a parent that imported TRL
    # (which lowers vLLM's level to ERROR in its own environment) must not silence it.
    env = OFFLINE_ENVIRONMENT | {"VLLM_LOGGING_LEVEL": "INFO"}
    if lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if on_cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(engine.cpu_kvcache_gib)
        local_ranks = layout.gpus_per_host
        if local_ranks > 1:
            # One OpenMP core set per rank, else vLLM refuses: "Not enough allowed NUMA nodes".
            env["VLLM_CPU_OMP_THREADS_BIND"] = _split_cores(local_ranks)
    elif rank.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, rank.gpus))
    if layout.hosts > 1 and rank.address:
        env["VLLM_HOST_IP"] = rank.address
    if layout.hosts > 1 and rank.interface:
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = rank.interface
    return HostCommand(host=host, role="head" if rank.node == 0 else "worker", argv=argv, env=env,
                       gpus=list(rank.gpus))


def _across_hosts(layout: PoolLayout, rank: Rank) -> list[str]:
    """vLLM's own multi-node flags: whole DP replicas per host (--data-parallel-*), else TP/PP
    over hosts (--nnodes); ranks other than the head run headless."""
    if layout.hosts == 1:
        return []
    headless = ["--headless"] if rank.node else []
    if layout.dp > 1:
        local = layout.dp // layout.hosts
        start = ["--data-parallel-start-rank", str(rank.node * local)] if rank.node else []
        return ["--data-parallel-size-local", str(local), "--data-parallel-address", rank.head,
                "--data-parallel-rpc-port", str(DP_RPC_PORT), *start, *headless]
    return ["--nnodes", str(layout.hosts), "--node-rank", str(rank.node), "--master-addr", rank.head,
            "--master-port", str(MASTER_PORT), *headless]


def _split_cores(ranks: int) -> str:
    """'0|1' style core lists, one per rank, from the cores this process may use."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // ranks)
    groups = [cores[i * per:(i + 1) * per] or [cores[-1]] for i in range(ranks)]
    return "|".join(",".join(str(c) for c in group) for group in groups)
