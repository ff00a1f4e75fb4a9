"""GPU sets for pools (appliance.gpus): TP groups inside an NVLink domain and, where possible, one
NUMA node; overlapping sets refused naming both pools; the planner only offers TP an NVLink
domain can hold."""

from __future__ import annotations

import pytest

from appliance.errors import SettingsError
from appliance.gpus import GpuRequest, assign, choose_gpus, nvlink_domains
from appliance.records import Gpu, HardwareProfile, Host
from installer.memory import GIB
from installer.model_config import load_model_config
from installer.planner import Pins, PlanError, plan
from tests.support.models import MODEL_CONFIGS


def islands(sizes: tuple[int, ...] = (4, 4), numa: tuple[int, ...] | None = None) -> Host:
    """GPUs in NVLink islands of `sizes` (e.g. two 4-GPU NVLink boards over PCIe); NUMA nodes per GPU."""
    gpus, start = [], 0
    for size in sizes:
        members = list(range(start, start + size))
        for index in members:
            gpus.append(Gpu(index=index, name="A100", memory_bytes=80 * GIB,
                            nvlink_peers=[peer for peer in members if peer != index] if size > 1 else [],
                            numa_node=numa[index] if numa else None))
        start += size
    return Host(name="gpu-1", gpus=gpus, numa_cpus={0: "0-15", 1: "16-31"})


def pcie(count: int, numa: tuple[int, ...]) -> Host:
    return Host(name="gpu-2", gpus=[Gpu(index=i, name="L40S", memory_bytes=48 * GIB, numa_node=numa[i])
                                    for i in range(count)])


def test_nvlink_domains() -> None:
    assert nvlink_domains(islands((4, 4))) == [{0, 1, 2, 3}, {4, 5, 6, 7}]
    assert nvlink_domains(pcie(4, (0, 0, 1, 1))) == [{0, 1, 2, 3}], "no NVLink at all: the host is one domain"
    one_way = Host(name="h", gpus=[Gpu(index=0, name="x", memory_bytes=1, nvlink_peers=[1]),
                                   Gpu(index=1, name="x", memory_bytes=1), Gpu(index=2, name="x", memory_bytes=1)])
    assert nvlink_domains(one_way) == [{0, 1}, {2}], "a link reported by one side joins both"


def test_tp_groups_stay_in_an_nvlink_domain_and_prefer_one_numa_node() -> None:
    host = islands((4, 4), numa=(0, 0, 1, 1, 1, 1, 1, 1))
    # TP 2: the second island's node-1 GPUs would do, but the tightest fit is GPUs 0,1 (node 0).
    assert choose_gpus(host, host.gpus, 2, 2) == (0, 1)
    # TP 4 from the first island would span NUMA nodes 0 and 1; the second island is on node 1 alone.
    assert choose_gpus(host, host.gpus, 4, 4) == (4, 5, 6, 7)
    assert choose_gpus(host, host.gpus, 8, 8) is None, "no NVLink domain holds 8"
    assert choose_gpus(host, host.gpus, 8, 4) == tuple(range(8)), "two TP-4 groups, one per island"
    on_pcie = pcie(4, (0, 1, 0, 1))
    assert choose_gpus(on_pcie, on_pcie.gpus, 2, 2) == (0, 2), "one NUMA node where possible"


def test_pools_get_disjoint_sets_and_overlaps_name_both_pools() -> None:
    host = islands((4, 4), numa=(0, 0, 0, 0, 1, 1, 1, 1))
    sets = assign([GpuRequest("full", 4, 4), GpuRequest("fast", 2, 2, fixed=(4, 5), source="pools.fast.gpus"),
                   GpuRequest("small", 1, 1)], host)
    assert sets == {"fast": (4, 5), "full": (0, 1, 2, 3), "small": (6,)}
    with pytest.raises(SettingsError, match="pools full and fast both hold GPU 1 on gpu-1"):
        assign([GpuRequest("full", 2, 2, fixed=(0, 1), source="pools.full.gpus"),
                GpuRequest("fast", 2, 2, fixed=(1, 2), source="pools.fast.gpus")], host)
    with pytest.raises(SettingsError, match=r"pools.fast.gpus: GPU 9 not on gpu-1 \(it has 0,1,2,3,4,5,6,7\)"):
        assign([GpuRequest("fast", 2, 2, fixed=(4, 9), source="pools.fast.gpus")], host)
    with pytest.raises(SettingsError, match="pools.fast.gpus: 1 distinct GPUs given; pool fast runs 2 ranks"):
        assign([GpuRequest("fast", 2, 2, fixed=(4, 4), source="pools.fast.gpus")], host)
    with pytest.raises(SettingsError, match=r"pool big needs 8 GPUs .* 2 of 8 are free \(held: 0 \(a\), 1 \(a\), "):
        assign([GpuRequest("a", 6, 2), GpuRequest("big", 8, 8)], host)


def test_planner_offers_only_tp_an_nvlink_domain_holds() -> None:
    profile = HardwareProfile(hosts=[islands((4, 4), numa=(0, 0, 0, 0, 1, 1, 1, 1))])
    model = load_model_config(MODEL_CONFIGS / "mixtral-8x22b.json")
    record = plan(model, profile, context=8192, concurrency=1)
    assert record.layout is not None and record.layout.tp <= 4
    assert all(command.gpus for command in record.commands)
    with pytest.raises(PlanError, match="--tp 8 is not possible: TP must be a power of two up to the 4 GPUs of "
                                        "one NVLink domain"):
        plan(model, profile, context=8192, concurrency=1, pins=Pins(tp=8))
