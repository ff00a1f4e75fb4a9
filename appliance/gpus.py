"""GPU sets for pools: which GPUs of a host each engine pool holds.

A tensor-parallel group is all-reduced every layer, so its GPUs must share an NVLink domain (GPUs
joined by NVLink, or the whole host where there is no NVLink at all) and, where possible, one NUMA
node (the CPU threads feeding them then use local memory). Pipeline stages and data-parallel
replicas are separate groups and may sit anywhere. A pool's set comes from its settings
(`pools.<name>.gpus`), from its plan, or is chosen here from the GPUs no other pool holds.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points

from appliance.errors import SettingsError
from appliance.records import Gpu, Host

HARDWARE_GROUP = "appliance.hardware"  # an entry point `local_host() -> Host` (the installer's profiler)


@dataclass(frozen=True)
class GpuRequest:
    """What one pool needs on this host."""

    pool: str
    count: int  # GPUs on this host (TP x PP x local DP)
    tp: int
    fixed: tuple[int, ...] | None = None  # a set given by settings or the plan
    source: str = ""  # where `fixed` came from, for errors


def local_host() -> Host:
    """This host's profile, from the installed profiler (the core does not read hardware itself)."""
    sources = list(entry_points(group=HARDWARE_GROUP, name="local_host"))
    if len(sources) != 1:
        raise SettingsError(f"{len(sources)} providers of {HARDWARE_GROUP}:local_host are installed; GPU sets need "
                            "exactly one (the installer's profiler)", hint="reinstall the appliance")
    host: Host = sources[0].load()()
    return host


def assign(requests: Sequence[GpuRequest], host: Host) -> dict[str, tuple[int, ...]]:
    """Each pool's GPU indexes on `host`. Fixed sets are checked (they exist, are the right size,
    overlap no other pool's); the other pools get TP groups chosen from the GPUs left, in order.
    SettingsError names the pools and GPUs when that cannot be done."""
    known = {gpu.index for gpu in host.gpus}
    holder: dict[int, str] = {}
    chosen: dict[str, tuple[int, ...]] = {}
    for request in requests:
        if request.fixed is None:
            continue
        unknown = sorted(set(request.fixed) - known)
        if unknown:
            raise SettingsError(f"{request.source}: GPU {_indexes(unknown)} not on {host.name} "
                                f"(it has {_indexes(sorted(known)) or 'no GPUs'})")
        if len(set(request.fixed)) != request.count:
            raise SettingsError(f"{request.source}: {len(set(request.fixed))} distinct GPUs given; pool "
                                f"{request.pool} runs {request.count} ranks here (TP x PP x DP)")
        for index in request.fixed:
            if index in holder:
                raise SettingsError(f"pools {holder[index]} and {request.pool} both hold GPU {index} on {host.name}",
                                    hint="give each pool its own GPUs (pools.<name>.gpus)")
            holder[index] = request.pool
        chosen[request.pool] = tuple(sorted(request.fixed))
    for request in requests:
        if request.fixed is not None:
            continue
        free = [gpu for gpu in host.gpus if gpu.index not in holder]
        picked = choose_gpus(host, free, request.count, request.tp)
        if picked is None:
            held = ", ".join(f"{index} ({pool})" for index, pool in sorted(holder.items())) or "none"
            raise SettingsError(f"pool {request.pool} needs {request.count} GPUs on {host.name} in TP groups of "
                                f"{request.tp} inside one NVLink domain; {len(free)} of {len(host.gpus)} are free "
                                f"(held: {held})", hint="give it fewer ranks, or free GPUs from another pool")
        holder.update((index, request.pool) for index in picked)
        chosen[request.pool] = picked
    return chosen


def choose_gpus(host: Host, free: Sequence[Gpu], count: int, tp: int) -> tuple[int, ...] | None:
    """`count` GPUs from `free` as TP groups of `tp`, each inside one NVLink domain and, where
    possible, one NUMA node; tightest fit first, lowest indexes on ties. None if they do not fit."""
    left = {gpu.index: gpu for gpu in free}
    picked: list[int] = []
    for _ in range(count // tp):
        group = _tp_group(host, left, tp)
        if group is None:
            return None
        picked += group
        for index in group:
            del left[index]
    return tuple(sorted(picked))


def _tp_group(host: Host, free: dict[int, Gpu], tp: int) -> list[int] | None:
    options: list[tuple[int, int, list[int]]] = []  # (spans NUMA nodes, spare GPUs left, group)
    for domain in nvlink_domains(host):
        present = [free[index] for index in sorted(domain) if index in free]
        if len(present) < tp:
            continue
        by_node: dict[int | None, list[int]] = defaultdict(list)
        for gpu in present:
            by_node[gpu.numa_node].append(gpu.index)
        fits = [indexes for indexes in by_node.values() if len(indexes) >= tp]
        if fits:
            tightest = min(fits, key=lambda indexes: (len(indexes), indexes))
            options.append((0, len(present) - tp, tightest[:tp]))
        else:
            options.append((1, len(present) - tp, [gpu.index for gpu in present][:tp]))
    return min(options, key=lambda option: (option[0], option[1], option[2]))[2] if options else None


def nvlink_domains(host: Host) -> list[set[int]]:
    """The host's GPUs grouped by NVLink reach; one group (PCIe) where no GPU has NVLink."""
    indexes = {gpu.index for gpu in host.gpus}
    if host.nvlink_all_to_all or not any(gpu.nvlink_peers for gpu in host.gpus):
        return [indexes] if indexes else []
    peers = {gpu.index: set(gpu.nvlink_peers) & indexes for gpu in host.gpus}
    domains: list[set[int]] = []
    seen: set[int] = set()
    for start in sorted(indexes):
        if start in seen:
            continue
        domain, todo = set(), [start]
        while todo:
            index = todo.pop()
            if index not in domain:
                domain.add(index)
                todo += peers[index] | {i for i, linked in peers.items() if index in linked}
        seen |= domain
        domains.append(domain)
    return domains


def numa_node(host: Host, indexes: Sequence[int]) -> int | None:
    """The NUMA node all of `indexes` sit on, or None (unknown, or spread over several)."""
    nodes = {gpu.numa_node for gpu in host.gpus if gpu.index in indexes}
    return nodes.pop() if len(nodes) == 1 else None


def _indexes(values: Sequence[int]) -> str:
    return ",".join(map(str, values))
