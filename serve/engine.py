"""The engine launcher: one supervised program per engine (each replica of a pool is one), running
the rank `appliance.engine_launch` builds from settings and, when a pool names one, its plan; on GPU
hosts each engine gets its own GPUs (`appliance.gpus`) and its CPU threads are bound to their NUMA
node.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import psutil

from appliance.durable import replace_file
from appliance.engine_launch import (
    PoolLayout,
    Rank,
    chat_template_file,
    engine_program,
    engine_socket,
    pool_layout,
    pool_plan,
    rank_command,
    replica_names,
    resolve_device,
)
from appliance.errors import SettingsError
from appliance.gpus import GpuRequest, assign, local_host, numa_node
from appliance.home import Home
from appliance.model_refs import model_dir, tiers_of_models
from appliance.programs import Program
from appliance.records import Host, Plan
from appliance.secrets import secret
from appliance.settings import DEMO_MODEL, PoolSettings, Settings
from appliance.tool_calling import tool_calling

ENGINE_KEY_SECRET = "engine-api-key"
ENGINE_BASE_URL = "http://engine"  # over an engine's Unix socket the host part only fills the Host header
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with its terminating NUL


@dataclass(frozen=True)
class EngineLaunch:
    """What supervisord needs to run one pool's vLLM server."""

    argv: list[str]
    environment: dict[str, str]
    model_dir: Path
    served_name: str


def checked_layout(pool: PoolSettings, settings: Settings) -> PoolLayout:
    """The pool's layout; one spanning hosts only where the cluster listener is on, and with one replica."""
    layout = pool_layout(pool, settings.engine)
    if layout.hosts > 1 and pool.replicas > 1:
        raise SettingsError(f"pools.{pool.name}.replicas: a pool spanning hosts runs one replica",
                            hint="serve more replicas as further pools, or plan it onto one host")
    if layout.hosts > 1 and settings.cluster.bind is None:
        raise SettingsError(f"pools.{pool.name}.plan: {pool.plan}: the plan spans {layout.hosts} hosts, but "
                            "cluster.bind is unset", hint="set cluster.bind to this host's address on the cluster "
                            "network, then `appliance hosts add` each worker the plan names")
    return layout


@dataclass(frozen=True)
class SpanningPool:
    """A pool whose plan spans hosts: the head is node 0, the plan's other hosts its workers."""

    pool: PoolSettings
    plan: Plan
    layout: PoolLayout

    @property
    def workers(self) -> list[str]:
        return [command.host for command in self.plan.commands[1:]]


def spanning_pools(settings: Settings) -> dict[str, SpanningPool]:
    pools = {}
    for pool in settings.pools:
        planned = pool_plan(pool)
        layout = pool_layout(pool, settings.engine)
        if planned is not None and layout.hosts > 1:
            pools[pool.name] = SpanningPool(pool, planned[0], layout)
    return pools


def interface_of(address: str) -> str | None:
    """The network interface holding `address` on this host (gloo and NCCL bind to it by name)."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(entry.address == address for entry in addresses):
            return name
    return None


def head_rank(settings: Settings, span: SpanningPool) -> Rank:
    address = str(settings.cluster.bind)
    return Rank(node=0, head=address, gpus=tuple(span.plan.commands[0].gpus), address=address,
                interface=interface_of(address))




def build_launch(pool: PoolSettings, settings: Settings, home: Home, api_key: str,
                 gpus: tuple[int, ...] = (), replica: str | None = None) -> EngineLaunch:
    """vLLM's argv and environment for `pool` (its `replica`, by default its first) on its `gpus`
    (reads only the pool's plan file, if any)."""
    device = resolve_device(settings.engine)
    layout = checked_layout(pool, settings)
    planned = pool_plan(pool)
    rank = head_rank(settings, SpanningPool(pool, planned[0], layout)) if planned and layout.hosts > 1 else Rank()
    command = rank_command(pool, settings, home, layout, device, replace(rank, gpus=gpus, replica=replica))
    # The key travels in the environment (the config file is 0600), never on the command line.
    environment = {"VLLM_API_KEY": api_key, **command.env}
    return EngineLaunch(argv=command.argv, environment=environment, model_dir=model_dir(pool, home),
                        served_name=command.argv[command.argv.index("--served-model-name") + 1])


def write_chat_template(home: Home, pool: PoolSettings, replica: str, model: Path) -> None:
    """The template the engine's arguments name, where the appliance gives it one (a ChatML model
    whose own template cannot show tools): written whole, replaced only when it changed."""
    tools = tool_calling(model, pool.tool_parser)
    if tools is None or tools.template is None:
        return
    path = chat_template_file(home, replica)
    with contextlib.suppress(OSError):
        if path.read_text() == tools.template:
            return
    path.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
    replace_file(path, tools.template.encode(), mode=0o644)


def gpu_sets(settings: Settings, host: Host) -> dict[str, tuple[int, ...]]:
    """Each engine's GPUs on this host, by replica name: its pool's setting (split among the
    replicas in order), its plan's (the first replica), or chosen from those left."""
    requests = []
    for pool in settings.pools:
        layout = checked_layout(pool, settings)
        count, source = layout.gpus_per_host, f"pools.{pool.name}.gpus"
        planned = pool_plan(pool)
        if pool.gpus is not None and len(pool.gpus) != count * pool.replicas:
            raise SettingsError(f"{source}: {len(pool.gpus)} GPUs given; pool {pool.name} runs {pool.replicas} "
                                f"replica(s) of {count} ranks here (TP x PP x DP each)")
        for index, replica in enumerate(replica_names(pool)):
            fixed = None
            if pool.gpus is not None:
                fixed = tuple(pool.gpus[index * count:(index + 1) * count])
            elif index == 0 and planned is not None and planned[0].commands and planned[0].commands[0].gpus:
                fixed, source = tuple(planned[0].commands[0].gpus), planned[1]
            requests.append(GpuRequest(replica, count, layout.local_tp, fixed, source))
    return assign(requests, host)


def bound_to_node(argv: list[str], host: Host, gpus: tuple[int, ...]) -> list[str]:
    """`argv` with its CPU threads on the NUMA node of its GPUs (where they share one and its CPUs
    are known): host-side work then uses memory local to them."""
    node = numa_node(host, gpus)
    cpus = host.numa_cpus.get(node) if node is not None else None
    return ["taskset", "-c", cpus, *argv] if cpus else argv


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
    """One supervised program per engine (the `appliance.programs` entry point): vllm-<pool>, and
    vllm-<pool>_<i> for a pool's further replicas."""
    api_key = secret(home, ENGINE_KEY_SECRET)
    on_gpus = resolve_device(settings.engine) == "cuda"
    host = local_host() if on_gpus else None
    sets = gpu_sets(settings, host) if host is not None else {}
    if not on_gpus:
        given = [pool.name for pool in settings.pools if pool.gpus is not None]
        if given:
            raise SettingsError(f"pools.{given[0]}.gpus: the CPU engine uses no GPUs", hint="remove it, or set "
                                "engine.device = \"cuda\" on a host with the CUDA engine")
    tiers_of_models(settings, home)  # pools serving one model each name a tier of their own
    programs = []
    for pool, replica in ((each, replica) for each in settings.pools for replica in replica_names(each)):
        gpus = sets.get(replica, ())
        launch = build_launch(pool, settings, home, api_key, gpus, replica)
        write_chat_template(home, pool, replica, launch.model_dir)
        socket = engine_socket(home, replica)
        problem = missing_model(launch.model_dir)
        if problem and pool.model == DEMO_MODEL:
            problem += " (run ./bootstrap.sh, or `appliance model prepare-demo`)"
        if len(str(socket).encode()) > MAX_SOCKET_PATH:
            problem = (f"its socket path {socket} is longer than the {MAX_SOCKET_PATH} bytes a Unix socket "
                       "allows: choose a shorter APPLIANCE_HOME")
        command = bound_to_node(launch.argv, host, gpus) if host is not None else launch.argv
        spans_hosts = pool_layout(pool, settings.engine).hosts > 1
        # Ranks of a pool spanning hosts reach the other hosts' over the cluster network: they
        # run in the host's network, and the cluster controller starts them (serve.cluster).
        if settings.engine.isolate_network and not spans_hosts:
            command, problem = in_own_network(command), problem or _missing_tools()
        programs.append(
            Program(
                name=engine_program(replica),
                command=command,
                environment=launch.environment,
                socket=socket,
                health_url=f"{ENGINE_BASE_URL}/health",
                urls={"openai": f"unix:{socket}"},
                model=launch.served_name,
                pool=pool.name,
                gpus=list(gpus),
                autostart=not spans_hosts,
                priority=50,
                startsecs=10,
                stopwaitsecs=60,
                start_timeout_s=settings.engine.start_timeout_s,
                missing=problem,
            )
        )
    return programs
