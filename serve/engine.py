"""The engine launcher: a vLLM OpenAI server's command line and environment, from settings and,
when a pool names one, a plan (`appliance plan --json`) that sets its layout and context length.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from appliance.errors import SettingsError
from appliance.home import Home
from appliance.model_refs import model_dir, served_name
from appliance.programs import OFFLINE_ENVIRONMENT, Program
from appliance.records import load_plan
from appliance.secrets import secret
from appliance.settings import DEMO_MODEL, EngineSettings, PoolSettings, Settings

ENGINE_KEY_SECRET = "engine-api-key"
ENGINE_BASE_URL = "http://engine"  # over an engine's Unix socket the host part only fills the Host header
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with its terminating NUL
# /dev/nvidiactl exists wherever the NVIDIA kernel driver is loaded.
NVIDIA_DEVICE = Path("/dev/nvidiactl")


@dataclass(frozen=True)
class EngineLaunch:
    """What supervisord needs to run one pool's vLLM server."""

    argv: list[str]
    environment: dict[str, str]
    model_dir: Path
    served_name: str
    device: str


def engine_socket(home: Home, pool: str) -> Path:
    """The Unix socket a pool's engine listens on, in the state dir's private (0700) run/engines/."""
    return home.run / "engines" / f"{pool}.sock"


def resolve_device(engine: EngineSettings) -> str:
    """'cuda' or 'cpu': the setting, or (auto) whether an NVIDIA driver is loaded."""
    if engine.device != "auto":
        return engine.device
    return "cuda" if NVIDIA_DEVICE.exists() else "cpu"


def resolve_dtype(engine: EngineSettings, device: str) -> str:
    """vLLM's --dtype: the setting, or bfloat16 on cuda and float32 on cpu (vLLM's CPU bfloat16
    kernels changed the demo model's greedy answers on AMX hosts)."""
    return engine.dtype or ("float32" if device == "cpu" else "bfloat16")


@dataclass(frozen=True)
class PoolLayout:
    tp: int
    pp: int
    dp: int
    ep: bool
    max_model_len: int


def pool_layout(pool: PoolSettings, engine: EngineSettings) -> PoolLayout:
    """The pool's parallel layout and context length: from its plan file if it names one."""
    if pool.plan is None:
        return PoolLayout(pool.tensor_parallel_size, pool.pipeline_parallel_size, pool.data_parallel_size,
                          pool.enable_expert_parallel, pool.max_model_len or engine.max_model_len)
    path = Path(pool.plan).expanduser()
    where = f"pools.{pool.name}.plan: {path}"
    plan = load_plan(path, where, SettingsError)
    if plan.layout is None:
        raise SettingsError(f"{where}: the plan found no feasible layout", hint="plan again with more hardware")
    if plan.layout.hosts > 1:
        raise SettingsError(f"{where}: the plan spans {plan.layout.hosts} hosts; this appliance runs one",
                            hint="plan for one host, or run each host's command from the plan")
    return PoolLayout(plan.layout.tp, plan.layout.pp, plan.layout.dp, plan.layout.ep, plan.target.context)


def build_launch(pool: PoolSettings, settings: Settings, home: Home, api_key: str) -> EngineLaunch:
    """vLLM's argv and environment for `pool` (reads only the pool's plan file, if any)."""
    engine = settings.engine
    layout = pool_layout(pool, engine)
    device = resolve_device(engine)
    path = model_dir(pool, home)
    served = served_name(pool, home)
    on_cpu = device == "cpu"
    utilization = engine.gpu_memory_utilization or (0.3 if on_cpu else 0.9)
    eager = engine.enforce_eager if engine.enforce_eager is not None else on_cpu
    argv = [
        # -P: never import from the working directory (the state dir holds an audit/ folder).
        sys.executable, "-P", "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(path),
        "--served-model-name", served,
        "--uds", str(engine_socket(home, pool.name)),
        "--dtype", resolve_dtype(engine, device),
        "--max-model-len", str(layout.max_model_len),
        "--gpu-memory-utilization", str(utilization),
        "--tensor-parallel-size", str(layout.tp),
        "--pipeline-parallel-size", str(layout.pp),
        "--data-parallel-size", str(layout.dp),
        "--disable-uvicorn-access-log",
    ]
    if eager:
        argv.append("--enforce-eager")
    if layout.ep:
        argv.append("--enable-expert-parallel")
    if pool.enable_lora:
        argv += ["--enable-lora", "--max-lora-rank", str(pool.max_lora_rank),
                 "--max-loras", str(pool.max_loras)]
    argv += pool.extra_args

    # The key travels in the environment (the config file is 0600), never on the command line.
    env = {"VLLM_API_KEY": api_key, **OFFLINE_ENVIRONMENT}
    if pool.enable_lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if on_cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(engine.cpu_kvcache_gib)
        ranks = layout.tp * layout.pp
        if ranks > 1:
            # One OpenMP core set per rank, else vLLM refuses: "Not enough allowed NUMA nodes".
            env["VLLM_CPU_OMP_THREADS_BIND"] = _split_cores(ranks)
    return EngineLaunch(argv=argv, environment=env, model_dir=path, served_name=served, device=device)


def _split_cores(ranks: int) -> str:
    """'0|1' style core lists, one per rank, from the cores this process may use."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // ranks)
    groups = [cores[i * per:(i + 1) * per] or [cores[-1]] for i in range(ranks)]
    return "|".join(",".join(str(c) for c in group) for group in groups)


def in_own_network(argv: list[str]) -> list[str]:
    """`argv` in a new network namespace holding only a loopback device (brought up): vLLM's
    internal listeners (ZMQ, torch.distributed, on 127.0.0.1) are then reachable from nowhere
    else; its API is on its Unix socket, which a network namespace does not hide."""
    # Root may create a network namespace directly; anyone else needs a user namespace for it.
    isolate = ["unshare", "--net", *([] if os.geteuid() == 0 else ["--map-root-user"]), "--"]
    return [*isolate, "sh", "-c", 'ip link set lo up && exec "$@"', "vllm", *argv]


def _missing_tools() -> str | None:
    lacking = [tool for tool, package in (("unshare", "util-linux"), ("ip", "iproute2")) if shutil.which(tool) is None]
    if lacking:
        return (f"engine.isolate_network needs {' and '.join(lacking)} (util-linux, iproute2): install them, "
                "or set engine.isolate_network = false")
    return None


def missing_model(path: Path) -> str | None:
    """Why `path` is not a servable checkpoint, or None."""
    if not (path / "config.json").is_file():
        return f"model not found: {path} has no config.json"
    if not any(path.glob("*.safetensors")):
        return f"model not found: {path} has no *.safetensors weights"
    return None


def engine_programs(settings: Settings, home: Home) -> list[Program]:
    """One supervised vllm-<pool> program per pool (the `appliance.programs` entry point)."""
    api_key = secret(home, ENGINE_KEY_SECRET)
    programs = []
    for pool in settings.pools:
        launch = build_launch(pool, settings, home, api_key)
        socket = engine_socket(home, pool.name)
        problem = missing_model(launch.model_dir)
        if problem and pool.model == DEMO_MODEL:
            problem += " (run ./bootstrap.sh, or `appliance model prepare-demo`)"
        if len(str(socket).encode()) > MAX_SOCKET_PATH:
            problem = (f"its socket path {socket} is longer than the {MAX_SOCKET_PATH} bytes a Unix socket "
                       "allows: choose a shorter APPLIANCE_HOME")
        command = launch.argv
        if settings.engine.isolate_network:
            command, problem = in_own_network(command), problem or _missing_tools()
        programs.append(
            Program(
                name=f"vllm-{pool.name}",
                command=command,
                environment=launch.environment,
                socket=socket,
                health_url=f"{ENGINE_BASE_URL}/health",
                urls={"openai": f"unix:{socket}"},
                model=launch.served_name,
                pool=pool.name,
                priority=50,
                startsecs=10,
                stopwaitsecs=60,
                start_timeout_s=settings.engine.start_timeout_s,
                missing=problem,
            )
        )
    return programs
