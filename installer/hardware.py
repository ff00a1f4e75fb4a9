"""Hardware profiles: detected on this host (NVML, /proc, /sys), read from a hand-written cluster
file (JSON or TOML), or made from a shorthand such as `2x8xH100-80GB`.

Detection is best-effort field by field: a query the driver or kernel cannot answer leaves that
field unset and never aborts the profile, because a partial profile is still worth planning on
and preflight says what is missing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pynvml
from pydantic import ValidationError

from appliance.errors import ApplianceError
from appliance.records import Disk, Gpu, HardwareProfile, Host, Nic, read_regular_file

T = TypeVar("T")

# Filesystems that hold data (weights can be staged there); pseudo and memory filesystems are not
# listed. overlay is the root filesystem of a container, so staging in one lands on it.
DATA_FILESYSTEMS = frozenset({
    "ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "overlay",
    "nfs", "nfs4", "cifs", "lustre", "gpfs", "beegfs", "ceph", "fuse.juicefs",
})
ARPHRD_INFINIBAND = 32  # /sys/class/net/X/type of an IPoIB interface (linux/if_arp.h)
# Parts whose multi-GPU boards join every GPU by NVLink/NVSwitch (SXM/HGX). PCIe parts do not.
NVLINK_PARTS = frozenset({"H100", "H200", "H20", "A100", "B100", "B200", "GB200"})
# The shorthand's limits: the planner suggests up to 64 hosts; an NVL72 rack is 72 GPUs in one
# NVLink domain; no GPU has 4 TiB. Each GPU lists its NVLink peers, so a host's size is squared.
SPEC_MAX_HOSTS = 64
SPEC_MAX_GPUS = 72
SPEC_MAX_GIB = 4096
SPEC_HINT = (f"e.g. 2x8xH100-80GB: 2 hosts, each with 8 H100 of 80 GiB (at most {SPEC_MAX_HOSTS} hosts, "
             f"{SPEC_MAX_GPUS} GPUs a host, {SPEC_MAX_GIB} GiB a GPU)")
PROFILE_MAX_BYTES = 16 << 20  # 1024 hosts of 8 GPUs, every field filled, are a few MiB


class ProfileError(ApplianceError):
    """A hardware profile file or shorthand is invalid."""


# --- detection: NVML -----------------------------------------------------------------------


@dataclass
class _Links:
    """What one GPU's NVLinks reach, before PCI bus ids are mapped to GPU indexes."""

    active: int = 0
    remote_buses: set[str] = field(default_factory=set)
    via_switch: bool = False


def _try(nvml: Any, query: Callable[..., T], *args: Any) -> T | None:
    """One NVML query, or None if the driver cannot answer it (unsupported, old driver...)."""
    try:
        return query(*args)
    except nvml.NVMLError:
        return None


def _text(value: str | bytes | None) -> str | None:
    """NVML strings come back as bytes from some pynvml versions and str from others."""
    return value.decode() if isinstance(value, bytes) else value


def _bus_id(raw: str | bytes | None) -> str | None:
    """'00000000:1B:00.0' (NVML) -> '0000:1b:00.0' (the form /sys and lspci use)."""
    text = _text(raw)
    if not text:
        return None
    domain, _, rest = text.lower().partition(":")
    return f"{domain[-4:]}:{rest}"


def _cuda_version(value: int | None) -> str | None:
    """12080 -> '12.8' (NVML encodes the driver's CUDA version as 1000*major + 10*minor)."""
    return None if not value else f"{value // 1000}.{value % 1000 // 10}"


def _nvlinks(nvml: Any, handle: Any) -> _Links:
    """Active links, and the PCI bus of each link's far end (or that it ends at an NVSwitch)."""
    links = _Links()
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        if _try(nvml, nvml.nvmlDeviceGetNvLinkState, handle, link) != nvml.NVML_FEATURE_ENABLED:
            continue
        links.active += 1
        kind = _try(nvml, nvml.nvmlDeviceGetNvLinkRemoteDeviceType, handle, link)
        if kind == nvml.NVML_NVLINK_DEVICE_TYPE_SWITCH:
            links.via_switch = True
            continue
        remote = _try(nvml, nvml.nvmlDeviceGetNvLinkRemotePciInfo, handle, link)
        bus = _bus_id(getattr(remote, "busId", None))
        if bus:
            links.remote_buses.add(bus)
    return links


def _pci_numa_node(root: Path, bus_id: str | None) -> int | None:
    """The GPU's NUMA node from sysfs: older drivers lack nvmlDeviceGetNumaNodeId."""
    raw = _read(root / "sys/bus/pci/devices" / bus_id / "numa_node") if bus_id else None
    return _numa(int(raw)) if raw and raw.lstrip("-").isdigit() else None


def _numa(node: int | None) -> int | None:
    return node if node is not None and node >= 0 else None  # -1: no NUMA affinity


def _gpu(nvml: Any, index: int, handle: Any, root: Path) -> Gpu:
    """One GPU's identity and health; NVLink peers are filled in once every GPU is known."""
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)  # no default: a GPU without memory is unusable
    bus = _bus_id(getattr(_try(nvml, nvml.nvmlDeviceGetPciInfo, handle), "busId", None))
    capability = _try(nvml, nvml.nvmlDeviceGetCudaComputeCapability, handle)
    mig = _try(nvml, nvml.nvmlDeviceGetMigMode, handle)
    ecc = _try(nvml, nvml.nvmlDeviceGetTotalEccErrors, handle,
               nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
    rows = _try(nvml, nvml.nvmlDeviceGetRemappedRows, handle)  # (corrected, uncorrected, pending, failed)
    numa = _numa(_try(nvml, nvml.nvmlDeviceGetNumaNodeId, handle))
    power = _try(nvml, nvml.nvmlDeviceGetPowerUsage, handle)  # milliwatts
    utilization = _try(nvml, nvml.nvmlDeviceGetUtilizationRates, handle)
    return Gpu(
        index=index,
        name=_text(_try(nvml, nvml.nvmlDeviceGetName, handle)) or "unknown",
        memory_bytes=memory.total,
        uuid=_text(_try(nvml, nvml.nvmlDeviceGetUUID, handle)),
        pci_bus_id=bus,
        compute_capability=f"{capability[0]}.{capability[1]}" if capability else None,
        numa_node=numa if numa is not None else _pci_numa_node(root, bus),
        mig_enabled=mig is not None and mig[0] == nvml.NVML_DEVICE_MIG_ENABLE,
        ecc_errors=ecc or 0,
        remapped_rows_pending=rows is not None and bool(rows[2]),
        power_watts=power / 1000 if power is not None else None,
        utilization_percent=getattr(utilization, "gpu", None),
    )


TOPOLOGY_LEVELS = {0: "INTERNAL", 10: "SINGLE", 20: "MULTIPLE", 30: "HOSTBRIDGE", 40: "NODE", 50: "SYSTEM"}


def _with_topology(nvml: Any, gpus: list[Gpu], handles: dict[int, Any]) -> list[Gpu]:
    """Each pair's common PCI ancestor and whether NVLink peer-to-peer works between them."""
    result = []
    for gpu in gpus:
        topology, p2p = {}, []
        for other in gpus:
            if other.index == gpu.index:
                continue
            pair = (handles[gpu.index], handles[other.index])
            level = _try(nvml, nvml.nvmlDeviceGetTopologyCommonAncestor, *pair)
            if level is not None:
                topology[other.index] = TOPOLOGY_LEVELS.get(int(level), str(level))
            if (_try(nvml, nvml.nvmlDeviceGetP2PStatus, *pair, nvml.NVML_P2P_CAPS_INDEX_NVLINK)
                    == nvml.NVML_P2P_STATUS_OK):
                p2p.append(other.index)
        result.append(gpu.model_copy(update={"topology": topology, "p2p_peers": p2p}))
    return result


def _with_peers(gpus: list[Gpu], links: dict[int, _Links]) -> list[Gpu]:
    """Map each GPU's remote PCI buses to GPU indexes; GPUs on an NVSwitch all reach each other."""
    by_bus = {gpu.pci_bus_id: gpu.index for gpu in gpus if gpu.pci_bus_id}
    switched = {index for index, link in links.items() if link.via_switch}
    result = []
    for gpu in gpus:
        link = links[gpu.index]
        peers = {by_bus[bus] for bus in link.remote_buses if bus in by_bus}
        if link.via_switch:
            peers |= switched
        peers.discard(gpu.index)
        result.append(gpu.model_copy(update={"nvlink_peers": sorted(peers), "nvlink_links": link.active}))
    return result


def read_gpus(nvml: Any, root: Path = Path("/")) -> tuple[list[Gpu], list[str]]:
    """Every GPU NVML lists (after nvmlInit), and why each one that could not be read failed.

    `nvml` is the pynvml module, or a stand-in for it in tests.
    """
    gpus: list[Gpu] = []
    links: dict[int, _Links] = {}
    handles: dict[int, Any] = {}
    errors: list[str] = []
    count = _try(nvml, nvml.nvmlDeviceGetCount)
    if count is None:
        return [], ["NVML initialised but could not count the GPUs"]
    for index in range(count):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            gpus.append(_gpu(nvml, index, handle, root))
        except nvml.NVMLError as exc:
            errors.append(f"GPU {index}: {exc}")
            continue
        links[index] = _nvlinks(nvml, handle)
        handles[index] = handle
    return _with_topology(nvml, _with_peers(gpus, links), handles), errors


def _all_to_all(gpus: list[Gpu]) -> bool:
    """Every GPU reaches every other over NVLink: the host is one tensor-parallel domain."""
    indexes = {gpu.index for gpu in gpus}
    return len(gpus) > 1 and all(set(gpu.nvlink_peers) == indexes - {gpu.index} for gpu in gpus)


def _gpu_fields(nvml: Any, root: Path) -> dict[str, Any]:
    """Host fields NVML provides; none at all when there is no driver (the CPU engine is used)."""
    try:
        nvml.nvmlInit()
    except nvml.NVMLError:
        return {}
    try:
        gpus, errors = read_gpus(nvml, root)
        return {
            "gpus": gpus,
            "gpu_errors": errors,
            "nvlink_all_to_all": _all_to_all(gpus),
            "driver_version": _text(_try(nvml, nvml.nvmlSystemGetDriverVersion)),
            "cuda_version": _cuda_version(_try(nvml, nvml.nvmlSystemGetCudaDriverVersion)),
        }
    finally:
        _try(nvml, nvml.nvmlShutdown)


# --- detection: /proc and /sys -------------------------------------------------------------


def _read(path: Path) -> str | None:
    """A small /proc or /sys file, stripped; None if absent or unreadable (EINVAL on a down link)."""
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cpu(root: Path) -> tuple[str | None, int | None]:
    """CPU model and logical core count from /proc/cpuinfo (ARM has no 'model name')."""
    lines = (_read(root / "proc/cpuinfo") or "").splitlines()
    models = [line.partition(":")[2].strip() for line in lines if line.startswith("model name")]
    cores = sum(1 for line in lines if line.startswith("processor"))
    return (models[0] if models else None), (cores or os.cpu_count())


def _ram_bytes(root: Path) -> int | None:
    """MemTotal from /proc/meminfo (reported in KiB)."""
    for line in (_read(root / "proc/meminfo") or "").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return None


def _numa_nodes(root: Path) -> int | None:
    """NUMA nodes the kernel knows; None where sysfs has no node directory."""
    nodes = list((root / "sys/devices/system/node").glob("node[0-9]*"))
    return len(nodes) or None


def _unescape(text: str) -> str:
    """/proc/mounts writes space, tab, newline and backslash as octal escapes (\\040...)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def _rotational(root: Path, device: str) -> bool | None:
    """Whether a block device spins, from its queue (a partition's queue is its disk's)."""
    if not device.startswith("/dev/"):
        return None  # network or pool filesystems (nfs, zfs) have no single block device
    name = Path(os.path.realpath(root / device.lstrip("/"))).name  # /dev/mapper/x -> dm-0
    block = (root / "sys/class/block" / name).resolve()
    for candidate in (block, block.parent):
        flag = _read(candidate / "queue/rotational")
        if flag is not None:
            return flag == "1"
    return None


def _disks(root: Path) -> list[Disk]:
    """Data filesystems from /proc/mounts, one entry per device, with free and total space."""
    disks: list[Disk] = []
    seen: set[str] = set()
    for line in (_read(root / "proc/mounts") or "").splitlines():
        parts = line.split()
        if len(parts) < 3 or parts[2] not in DATA_FILESYSTEMS or parts[0] in seen:
            continue
        mount = _unescape(parts[1])
        path = root / mount.lstrip("/")
        try:
            if not stat.S_ISDIR(os.stat(path).st_mode):
                continue  # a bind-mounted file (containers mount /etc/hosts so): nowhere to stage
            usage = shutil.disk_usage(path)
        except OSError:
            continue  # gone since /proc/mounts was read, a stale network mount (ESTALE), or not ours to enter
        seen.add(parts[0])
        disks.append(Disk(mount=mount, free_bytes=usage.free, total_bytes=usage.total,
                          rotational=_rotational(root, parts[0])))
    return disks


def _speed_mbps(raw: str | None) -> int | None:
    """/sys/class/net/X/speed: Mb/s, or -1 / unreadable when the link is down."""
    return int(raw) if raw and raw.isdigit() and int(raw) > 0 else None


def _net_interfaces(root: Path) -> list[Nic]:
    """Network interfaces except loopback; IPoIB ones are marked infiniband."""
    nics = []
    for path in sorted((root / "sys/class/net").glob("*")):
        if path.name == "lo":
            continue
        kind = "infiniband" if _read(path / "type") == str(ARPHRD_INFINIBAND) else "ethernet"
        nics.append(Nic(name=path.name, kind=kind, speed_mbps=_speed_mbps(_read(path / "speed"))))
    return nics


def _ib_ports(root: Path) -> list[Nic]:
    """RDMA ports (mlx5_0/1...); the link layer tells InfiniBand from RoCE (Ethernet)."""
    nics = []
    for port in sorted((root / "sys/class/infiniband").glob("*/ports/*")):
        rate = (_read(port / "rate") or "").split()  # '400 Gb/sec (4X NDR)'
        layer = _read(port / "link_layer") or ""
        nics.append(Nic(
            name=f"{port.parent.parent.name}/{port.name}",
            kind="infiniband" if layer.lower() == "infiniband" else "ethernet",
            speed_mbps=int(float(rate[0]) * 1000) if rate and _is_number(rate[0]) else None,
        ))
    return nics


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _numa_cpus(root: Path) -> dict[int, str]:
    """Each NUMA node's CPU list as the kernel writes it ('0-23,48-71')."""
    cpus = {}
    for node in (root / "sys/devices/system/node").glob("node[0-9]*"):
        listed = _read(node / "cpulist")
        if listed and node.name[4:].isdigit():
            cpus[int(node.name[4:])] = listed
    return cpus


def local_host() -> Host:
    """This host's profile (the core's `appliance.hardware` entry point: GPU sets for pools)."""
    return detect().hosts[0]


def detect(root: Path = Path("/"), nvml: Any = pynvml) -> HardwareProfile:
    """This host's profile. `root` and `nvml` point elsewhere only in tests."""
    cpu_model, cores = _cpu(root)
    host = Host(
        name=socket.gethostname(),
        **_gpu_fields(nvml, root),
        cpu_model=cpu_model,
        cpu_cores=cores,
        ram_bytes=_ram_bytes(root),
        numa_nodes=_numa_nodes(root),
        numa_cpus=_numa_cpus(root),
        disks=_disks(root),
        nics=_net_interfaces(root) + _ib_ports(root),
    )
    return HardwareProfile(hosts=[host], source="detected")


# --- hand-written profiles -----------------------------------------------------------------


def load_profile(path: Path) -> HardwareProfile:
    """A cluster profile written by hand (.json or .toml); errors name the file, where and why."""
    data = _parse_file(path)
    try:
        return HardwareProfile.model_validate(data)
    except ValidationError as exc:
        problems = [_problem(error, data) for error in exc.errors()]
        raise ProfileError(f"{path}: {'; '.join(problems)}",
                           hint="see installer/profiles/example-2x8xH100.toml") from exc


def _parse_file(path: Path) -> Any:
    """The file's data; syntax errors carry the line."""
    try:
        text = read_regular_file(path, PROFILE_MAX_BYTES).decode()
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read the profile: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ProfileError(f"{path}: not UTF-8 text (byte {exc.start})") from exc
    suffix = path.suffix.lower()
    try:
        if suffix == ".json":
            return json.loads(text)
        if suffix == ".toml":
            return tomllib.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from exc
    except tomllib.TOMLDecodeError as exc:
        # Python 3.11's TOMLDecodeError has no lineno attribute; its message ends with it.
        line = re.search(r"line (\d+)", str(exc))
        raise ProfileError(f"{path}{':' + line.group(1) if line else ''}: not valid TOML: {exc}") from exc
    except RecursionError:
        raise ProfileError(f"{path}: nested too deeply to be a profile") from None
    raise ProfileError(f"{path}: unknown profile format {suffix or '(no suffix)'!r}",
                       hint="name the file .json or .toml")


def _problem(error: Any, data: Any) -> str:
    """'hosts.node-b.gpus[0].memory_bytes: Input should be greater than 0 (got 0)'."""
    message = str(error["msg"]).removeprefix("Value error, ")
    if error["type"] != "missing" and not isinstance(error["input"], (dict, list)):
        message += f" (got {error['input']!r})"
    return f"{_location(error['loc'], data)}: {message}"


def _location(loc: tuple[int | str, ...], data: Any) -> str:
    """Where in the file: hosts by their name when it is unique, other list items by index."""
    text, node = "", data
    for part in loc:
        child = _child(node, part)
        if isinstance(part, int):
            name = child.get("name") if text == "hosts" and isinstance(child, dict) else None
            names = [h.get("name") for h in node if isinstance(h, dict)] if name else []
            text += f".{name}" if isinstance(name, str) and names.count(name) == 1 else f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
        node = child
    return text or "profile"


def _child(node: Any, part: int | str) -> Any:
    if isinstance(node, dict):
        return node.get(part)
    if isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
        return node[part]
    return None


# --- shorthand -----------------------------------------------------------------------------

_SPEC = re.compile(r"(?P<hosts>\d{1,6})x(?P<gpus>\d{1,6})x(?P<name>[A-Za-z0-9][\w.-]{0,99})-(?P<memory>\d{1,6})"
                   r"(?:GB|GiB|G)?", re.IGNORECASE)


def parse_hardware_spec(spec: str) -> HardwareProfile:
    """`2x8xH100-80GB`: 2 hosts named node-0 and node-1, each with 8 H100 of 80 GiB.

    Vendors' "80GB" is the marketed size; the usable memory NVML reports is close to 80 GiB
    (an H100 80GB shows 81559 MiB), so MEMORY is read as GiB.
    """
    match = _SPEC.fullmatch(spec.strip())
    if not match:
        raise ProfileError(f"--hardware {spec[:200]!r} is not of the form HOSTSxGPUSxNAME-MEMORY", hint=SPEC_HINT)
    hosts, per_host, memory = (int(match[key]) for key in ("hosts", "gpus", "memory"))
    for part, value, limit in (("HOSTS", hosts, SPEC_MAX_HOSTS), ("GPUS", per_host, SPEC_MAX_GPUS),
                               ("MEMORY", memory, SPEC_MAX_GIB)):
        if not 1 <= value <= limit:
            raise ProfileError(f"--hardware {spec!r}: {part} in HOSTSxGPUSxNAME-MEMORY is {value}; it must be "
                               f"from 1 to {limit}", hint=SPEC_HINT)
    nvlink = per_host > 1 and match["name"].upper() in NVLINK_PARTS
    return HardwareProfile(
        hosts=[Host(name=f"node-{n}", gpus=_spec_gpus(match["name"], per_host, memory, nvlink),
                    nvlink_all_to_all=nvlink) for n in range(hosts)],
        source="spec",
    )


def _spec_gpus(name: str, count: int, memory_gib: int, nvlink: bool) -> list[Gpu]:
    """One host's GPUs, each reaching all the others when the part is NVLink-connected."""
    return [Gpu(index=i, name=name, memory_bytes=memory_gib * 2**30,
                nvlink_peers=[j for j in range(count) if j != i] if nvlink else [])
            for i in range(count)]
