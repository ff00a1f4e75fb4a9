"""Preflight: what would stop the appliance from installing, staging or serving, checked before it
tries. Each check passes, warns or fails with its reason in numbers and, if not a pass, the fix.
"""

from __future__ import annotations

import errno
import shutil
import socket
from collections import Counter
from pathlib import Path
from typing import Literal

import psutil
from pydantic import BaseModel, ConfigDict

from appliance.engine_build import Engine
from appliance.errors import ApplianceError
from appliance.home import Home
from appliance.records import HardwareProfile
from appliance.supervisor import Supervisor
from installer.keycloak import JDK_CANDIDATES

# The CUDA the locked engine is built for (requirements/lock-cuda.txt: nvidia-cuda-runtime 13.0), used
# when the installed build's own (appliance.engine_build.engine_cuda_version) cannot be read.
MIN_CUDA = (13, 0)
# The first driver branch of each CUDA version, for the fix.
CUDA_DRIVERS = {(12, 8): "R570", (12, 9): "R575", (13, 0): "R580"}
MIN_RAM_BYTES = 16 * 2**30
# Staging writes index and manifest files beside the weights, and a partial file while it works.
DISK_MARGIN = 1.1


class Check(BaseModel):
    """One preflight result; `fix` says what to do when it is not a pass."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    status: Literal["pass", "skip", "warn", "fail"]
    reason: str
    fix: str | None = None


def run_checks(profile: HardwareProfile, *, model_bytes: int | None, staging_dir: Path, ports: list[int],
               java_home: str | None, engine: Engine | None, engine_cuda: tuple[int, int] | None,
               need_java: bool = True, home: Home | None = None) -> list[Check]:
    """Every check, in the order an operator fixes things: GPUs, engine, driver, disk, memory,
    ports, Java.

    `need_java` is False when Keycloak is external (the appliance runs no Java then). `engine` is the
    installed vLLM build (None: none) and `engine_cuda` the CUDA version it was built for. `home` is
    the appliance whose own programs may hold `ports` (None: APPLIANCE_HOME's): a port it holds
    while it runs is no conflict.
    """
    return [
        _gpus(profile),
        _engine(profile, engine),
        _mixed_gpus(profile),
        _gpu_health(profile),
        _mig(profile),
        _cuda(profile, engine, engine_cuda or MIN_CUDA),
        _disk(staging_dir, model_bytes),
        _ram(profile),
        _ports(ports, home or Home.from_env()),
        _java(java_home) if need_java else Check(name="java", status="pass",
                                                  reason="Keycloak is external: no Java needed"),
    ]


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _gpus(profile: HardwareProfile) -> Check:
    """GPUs are present and every GPU the driver lists could be read."""
    broken = [f"{host.name}: {error}" for host in profile.hosts for error in host.gpu_errors]
    if broken:
        return Check(name="gpus", status="fail", reason=f"unreadable GPUs: {'; '.join(broken)}",
                     fix="look for Xid errors in `dmesg` and `nvidia-smi -q`; reset (nvidia-smi -r -i N) "
                         "or reseat the GPU")
    count = sum(len(host.gpus) for host in profile.hosts)
    if not count:
        return Check(name="gpus", status="warn", reason="no NVIDIA GPU: the CPU engine will be used",
                     fix="to serve on GPUs, install the NVIDIA driver and check that `nvidia-smi` lists them")
    return Check(name="gpus", status="pass", reason=f"{count} GPUs on {len(profile.hosts)} host(s)")


def _any_gpu(profile: HardwareProfile) -> bool:
    return any(host.gpus for host in profile.hosts)


def _skipped(name: str) -> Check:
    """A GPU check on hosts without GPUs: nothing was checked, so it claims nothing (it blocks
    nothing either: the gpus check already warns)."""
    return Check(name=name, status="skip", reason="skipped (no GPU)")


def _mixed_gpus(profile: HardwareProfile) -> Check:
    """One GPU type per host: tensor parallelism runs at the slowest GPU and sizes by the smallest."""
    mixed = []
    for host in profile.hosts:
        kinds = Counter(gpu.name for gpu in host.gpus)
        if len(kinds) > 1:
            mixed.append(f"{host.name} has " + ", ".join(f"{n} x {name}" for name, n in kinds.items()))
    if mixed:
        return Check(name="gpu types", status="fail", reason="; ".join(mixed),
                     fix="use GPUs of one type per host, or leave the odd ones out of the profile")
    return Check(name="gpu types", status="pass", reason="one GPU type per host")


def _gpu_health(profile: HardwareProfile) -> Check:
    """Uncorrected ECC errors or pending row remaps: the GPU may corrupt or lose data."""
    if not _any_gpu(profile):
        return _skipped("gpu memory health")
    bad = []
    for host in profile.hosts:
        for gpu in host.gpus:
            if gpu.ecc_errors:
                bad.append(f"{host.name} GPU {gpu.index}: {gpu.ecc_errors} uncorrected ECC errors")
            if gpu.remapped_rows_pending:
                bad.append(f"{host.name} GPU {gpu.index}: row remapping pending")
    if bad:
        return Check(name="gpu memory health", status="fail", reason="; ".join(bad),
                     fix="reset the GPU (nvidia-smi -r -i N) to apply pending remaps and clear volatile "
                         "counts; if uncorrected errors come back, drain and replace it")
    return Check(name="gpu memory health", status="pass",
                 reason="no uncorrected ECC errors or pending remaps")


def _mig(profile: HardwareProfile) -> Check:
    """MIG splits a GPU into slices the engine sees as small separate GPUs."""
    if not _any_gpu(profile):
        return _skipped("mig")
    on = [f"{host.name} GPU {gpu.index}" for host in profile.hosts for gpu in host.gpus if gpu.mig_enabled]
    if on:
        return Check(name="mig", status="warn", reason=f"MIG enabled on {', '.join(on)}",
                     fix="disable it (nvidia-smi -i N -mig 0, then reset the GPU) unless you mean to "
                         "serve from MIG slices")
    return Check(name="mig", status="pass", reason="MIG off on every GPU")


def _cuda_tuple(version: str | None) -> tuple[int, int] | None:
    """'12.8' -> (12, 8); None if absent or not MAJOR.MINOR."""
    parts = (version or "").split(".")
    if len(parts) < 2 or not (parts[0].isdigit() and parts[1].isdigit()):
        return None
    return int(parts[0]), int(parts[1])


def _engine(profile: HardwareProfile, engine: Engine | None) -> Check:
    """The installed vLLM build fits the hosts: CUDA where there are GPUs, CPU where there are none."""
    with_gpus = [host.name for host in profile.hosts if host.gpus]
    without = [host.name for host in profile.hosts if not host.gpus]
    if engine is None:
        return Check(name="engine", status="fail", reason="no vLLM engine is installed",
                     fix="run ./bootstrap.sh, or install.sh from a bundle")
    if engine == "cuda" and without:
        return Check(name="engine", status="fail",
                     reason=f"the CUDA engine is installed, but {', '.join(without)} has no NVIDIA GPU or driver",
                     fix="install the CPU engine there (./bootstrap.sh --engine cpu, or a bundle built with "
                         "--engine cpu), or install the NVIDIA driver")
    if engine == "cpu" and with_gpus:
        return Check(name="engine", status="warn",
                     reason=f"the CPU engine is installed: the GPUs of {', '.join(with_gpus)} go unused",
                     fix="install the CUDA engine (./bootstrap.sh --engine cuda, or a bundle built with "
                         "--engine cuda)")
    return Check(name="engine", status="pass", reason=f"the {engine.upper()} engine fits "
                 + ("the GPU hosts" if engine == "cuda" else "hosts without GPUs"))


def _cuda(profile: HardwareProfile, engine: Engine | None, build: tuple[int, int]) -> Check:
    """The driver must support the CUDA version the engine's wheels were built for."""
    need = ".".join(map(str, build))
    gpu_hosts = [host for host in profile.hosts if host.gpus]
    if engine != "cuda":
        return Check(name="cuda driver", status="pass",
                     reason="the CPU engine needs no CUDA driver" if engine else "no engine installed (see engine)")
    if not gpu_hosts:
        return Check(name="cuda driver", status="skip", reason="skipped (no GPU)")
    old = [h for h in gpu_hosts if (v := _cuda_tuple(h.cuda_version)) is not None and v < build]
    if old:
        said = "; ".join(f"{h.name}: driver {h.driver_version or '?'} supports CUDA {h.cuda_version}"
                         for h in old)
        branch = CUDA_DRIVERS.get(build)
        return Check(name="cuda driver", status="fail", reason=f"{said}; the engine needs CUDA {need}",
                     fix=f"install NVIDIA driver {branch + ' or newer' if branch else f'for CUDA {need}'}")
    unknown = [h.name for h in gpu_hosts if _cuda_tuple(h.cuda_version) is None]
    if unknown:
        return Check(name="cuda driver", status="warn",
                     reason=f"CUDA version unknown on {', '.join(unknown)}; the engine needs CUDA {need}",
                     fix="add cuda_version to the profile, or check `nvidia-smi` on those hosts")
    versions = sorted({h.cuda_version or "" for h in gpu_hosts})
    return Check(name="cuda driver", status="pass", reason=f"CUDA {', '.join(versions)} >= {need}")


def _existing(path: Path) -> Path:
    """The path, or its nearest existing parent: the filesystem it will be created on."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _disk(staging_dir: Path, model_bytes: int | None) -> Check:
    """Room to stage the model's weights, with a margin for the files staging writes beside them."""
    where = _existing(staging_dir)
    free = shutil.disk_usage(where).free
    if model_bytes is None:
        return Check(name="disk", status="pass",
                     reason=f"{_gib(free)} free at {staging_dir} "
                            "(no model size given; --model-bytes checks it)")
    need = model_bytes * DISK_MARGIN
    said = (f"{_gib(free)} free at {staging_dir}; the model needs {_gib(model_bytes)} "
            f"+ {DISK_MARGIN - 1:.0%} = {_gib(need)}")
    if free < need:
        return Check(name="disk", status="fail", reason=said,
                     fix=f"free {_gib(need - free)} there, or point APPLIANCE_HOME at a larger disk")
    return Check(name="disk", status="pass", reason=said)


def _ram(profile: HardwareProfile) -> Check:
    """Staging and the engine's host-side buffers need RAM beside the GPUs."""
    low = [h for h in profile.hosts if h.ram_bytes is not None and h.ram_bytes < MIN_RAM_BYTES]
    unknown = [h.name for h in profile.hosts if h.ram_bytes is None]
    if low:
        return Check(name="ram", status="warn",
                     reason="; ".join(f"{h.name}: {_gib(h.ram_bytes or 0)}" for h in low)
                     + f", below {_gib(MIN_RAM_BYTES)}",
                     fix="add memory, or stage weights on a larger host and copy them over")
    if unknown:
        return Check(name="ram", status="warn", reason=f"RAM not known for {', '.join(unknown)}",
                     fix="add ram_bytes to the profile for those hosts")
    said = "; ".join(f"{h.name}: {_gib(h.ram_bytes or 0)}" for h in profile.hosts)
    return Check(name="ram", status="pass", reason=f"{said} (>= {_gib(MIN_RAM_BYTES)})")


def _port_problem(port: int) -> str | None:
    """Why 127.0.0.1:port cannot be listened on ('in use', or the OS's reason), or None if free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # As servers do: a port left in TIME_WAIT by a stopped server is free to listen on.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            return "in use" if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
    return None


def _ports(ports: list[int], home: Home) -> Check:
    """The appliance's loopback ports must be free before `appliance up`, or held by this very
    appliance while it runs (then `up` has nothing to start)."""
    wanted = list(dict.fromkeys(ports))
    problems = {port: problem for port in wanted if (problem := _port_problem(port))}
    held = appliance_ports(home) if problems else {}
    problems = {port: problem for port, problem in problems.items() if port not in held}
    if problems:
        said = ", ".join(f"{port} ({problem})" for port, problem in problems.items())
        return Check(name="ports", status="fail",
                     reason=f"cannot listen on 127.0.0.1: {said}; {len(wanted)} ports needed",
                     fix="stop what listens there (`ss -ltnp`; `appliance down` if it is the appliance) "
                         "or change the port in settings.toml")
    free = ", ".join(str(port) for port in wanted if port not in held)
    ours = ", ".join(f"{port} ({held[port]})" for port in wanted if port in held)
    parts = [f"free on 127.0.0.1: {free or 'none needed'}"] if free or not ours else []
    if ours:
        parts.append(f"held by this appliance, which is running: {ours}")
    return Check(name="ports", status="pass", reason="; ".join(parts))


def appliance_ports(home: Home) -> dict[int, str]:
    """The TCP ports the running appliance of `home` listens on -> the supervisord program that
    holds each (its process or one it started); none when it is not running."""
    try:
        supervisor = Supervisor(home)
        programs = supervisor.processes() if supervisor.is_running() else []
    except ApplianceError:  # a state directory supervisord cannot use runs nothing
        return {}
    return {port: info.name for info in programs if info.pid for port in _listening(info.pid)}


def _listening(pid: int) -> set[int]:
    """The TCP ports a process and its descendants listen on (those still alive and readable)."""
    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)]
    except psutil.Error:
        return set()
    ports: set[int] = set()
    for process in family:
        try:
            connections = process.net_connections(kind="tcp")
        except psutil.Error:
            continue
        ports |= {c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN}
    return ports


def _java(java_home: str | None) -> Check:
    """The embedded Keycloak runs on Java: the configured JDK, else the first of the JDKs it
    looks for (not `java` on PATH, which Keycloak would not use)."""
    fix = "install a JDK 17+ (e.g. apt install openjdk-17-jre-headless) or set keycloak.java_home"
    if java_home:
        java = Path(java_home) / "bin" / "java"
        if java.is_file():
            return Check(name="java", status="pass", reason=f"java at {java}")
        return Check(name="java", status="fail", reason=f"no java at {java}", fix=fix)
    return Check(name="java", status="fail",
                 reason=f"no JDK where Keycloak looks ({', '.join(JDK_CANDIDATES)})", fix=fix)
