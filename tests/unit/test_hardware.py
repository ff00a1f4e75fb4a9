"""Hardware profiles: detection from NVML, /proc and /sys; hand-written cluster files;
the HOSTSxGPUSxNAME-MEMORY shorthand."""

from __future__ import annotations

import errno
import json
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml
import pytest

from installer.hardware import (
    ProfileError,
    detect,
    load_profile,
    parse_hardware_spec,
    read_gpus,
)

EXAMPLE = Path(__file__).parents[2] / "installer" / "profiles" / "example-2x8xH100.toml"


# --- a stand-in for the pynvml module ------------------------------------------------------


class FakeNvmlError(Exception):
    """pynvml.NVMLError in the fake."""


@dataclass
class FakeGpu:
    bus: str  # as NVML writes it: '00000000:1B:00.0'
    name: str = "NVIDIA H100 80GB HBM3"
    memory: int = 80 * 2**30
    links: dict[int, str] = field(default_factory=dict)  # link -> remote bus, or 'switch'
    mig: int = 0
    ecc: int = 0
    remap_pending: int = 0
    numa: int = 0
    failing: set[str] = field(default_factory=set)  # NVML functions that raise for this GPU


class FakeNvml:
    """Answers the pynvml calls the profiler makes from a list of FakeGpu; constants are pynvml's."""

    NVMLError = FakeNvmlError
    NVML_NVLINK_MAX_LINKS = 4
    NVML_FEATURE_ENABLED = pynvml.NVML_FEATURE_ENABLED
    NVML_NVLINK_DEVICE_TYPE_SWITCH = pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
    NVML_NVLINK_DEVICE_TYPE_GPU = pynvml.NVML_NVLINK_DEVICE_TYPE_GPU
    NVML_DEVICE_MIG_ENABLE = pynvml.NVML_DEVICE_MIG_ENABLE
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    NVML_VOLATILE_ECC = pynvml.NVML_VOLATILE_ECC
    NVML_P2P_CAPS_INDEX_NVLINK = pynvml.NVML_P2P_CAPS_INDEX_NVLINK
    NVML_P2P_STATUS_OK = pynvml.NVML_P2P_STATUS_OK

    def __init__(self, gpus: list[FakeGpu], *, init_error: str | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.shut_down = False

    def __getattr__(self, name: str) -> Callable[..., Any]:
        """Every nvml* call: raise if the GPU it is about lists it as failing, else answer it."""
        answer = getattr(self, f"_{name}")

        def call(*args: Any) -> Any:
            if args and isinstance(args[0], FakeGpu) and name in args[0].failing:
                raise FakeNvmlError(f"{name}: Not Supported")
            return answer(*args)

        return call

    def _nvmlInit(self) -> None:
        if self.init_error:
            raise FakeNvmlError(self.init_error)

    def _nvmlShutdown(self) -> None:
        self.shut_down = True

    def _nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def _nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        gpu = self.gpus[index]
        if "handle" in gpu.failing:
            raise FakeNvmlError("GPU is lost")
        return gpu

    def _nvmlSystemGetDriverVersion(self) -> bytes:
        return b"570.124.06"

    def _nvmlSystemGetCudaDriverVersion(self) -> int:
        return 12080

    def _nvmlDeviceGetName(self, gpu: FakeGpu) -> bytes:
        return gpu.name.encode()

    def _nvmlDeviceGetUUID(self, gpu: FakeGpu) -> str:
        return f"GPU-{gpu.bus}"

    def _nvmlDeviceGetMemoryInfo(self, gpu: FakeGpu) -> Any:
        return type("Memory", (), {"total": gpu.memory})()

    def _nvmlDeviceGetPciInfo(self, gpu: FakeGpu) -> Any:
        return type("Pci", (), {"busId": gpu.bus.encode()})()

    def _nvmlDeviceGetCudaComputeCapability(self, gpu: FakeGpu) -> tuple[int, int]:
        return (9, 0)

    def _nvmlDeviceGetNumaNodeId(self, gpu: FakeGpu) -> int:
        return gpu.numa

    def _nvmlDeviceGetMigMode(self, gpu: FakeGpu) -> list[int]:
        return [gpu.mig, gpu.mig]

    def _nvmlDeviceGetTotalEccErrors(self, gpu: FakeGpu, error_type: int, counter: int) -> int:
        assert (error_type, counter) == (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
        return gpu.ecc

    def _nvmlDeviceGetRemappedRows(self, gpu: FakeGpu) -> tuple[int, int, int, int]:
        return (0, 0, gpu.remap_pending, 0)

    def _nvmlDeviceGetNvLinkState(self, gpu: FakeGpu, link: int) -> int:
        if link not in gpu.links:
            raise FakeNvmlError("Not Supported")  # what NVML says for a link the GPU lacks
        return pynvml.NVML_FEATURE_ENABLED

    def _nvmlDeviceGetNvLinkRemoteDeviceType(self, gpu: FakeGpu, link: int) -> int:
        return (pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH if gpu.links[link] == "switch"
                else pynvml.NVML_NVLINK_DEVICE_TYPE_GPU)

    def _nvmlDeviceGetNvLinkRemotePciInfo(self, gpu: FakeGpu, link: int) -> Any:
        return type("Pci", (), {"busId": gpu.links[link].encode()})()

    def _nvmlDeviceGetPowerUsage(self, gpu: FakeGpu) -> int:
        return 312_500  # milliwatts

    def _nvmlDeviceGetUtilizationRates(self, gpu: FakeGpu) -> Any:
        return type("Utilization", (), {"gpu": 37, "memory": 12})()

    def _linked(self, gpu: FakeGpu, other: FakeGpu) -> bool:
        ends = set(gpu.links.values())
        return other.bus in ends or ("switch" in ends and "switch" in other.links.values())

    def _nvmlDeviceGetTopologyCommonAncestor(self, gpu: FakeGpu, other: FakeGpu) -> int:
        return pynvml.NVML_TOPOLOGY_SINGLE if gpu.numa == other.numa else pynvml.NVML_TOPOLOGY_SYSTEM

    def _nvmlDeviceGetP2PStatus(self, gpu: FakeGpu, other: FakeGpu, capability: int) -> int:
        assert capability == pynvml.NVML_P2P_CAPS_INDEX_NVLINK
        return pynvml.NVML_P2P_STATUS_OK if self._linked(gpu, other) else pynvml.NVML_P2P_STATUS_NOT_SUPPORTED


BUS = ["00000000:1B:00.0", "00000000:43:00.0", "00000000:52:00.0"]


def test_nvlink_peers_are_mapped_from_remote_pci_bus_ids(tmp_path: Path) -> None:
    nvml = FakeNvml([
        FakeGpu(BUS[0], links={0: BUS[1], 1: BUS[2]}, mig=1),
        FakeGpu(BUS[1], links={0: BUS[0], 1: BUS[2], 2: BUS[2]}, ecc=3, remap_pending=1),
        FakeGpu(BUS[2], links={0: BUS[0], 1: BUS[1]}, failing={"nvmlDeviceGetUUID"}),
    ])
    gpus, errors = read_gpus(nvml, tmp_path)
    assert errors == []
    assert [g.nvlink_peers for g in gpus] == [[1, 2], [0, 2], [0, 1]]
    assert [g.nvlink_links for g in gpus] == [2, 3, 2]
    assert gpus[0].pci_bus_id == "0000:1b:00.0"
    assert gpus[0].name == "NVIDIA H100 80GB HBM3" and gpus[0].compute_capability == "9.0"
    assert gpus[0].mig_enabled and not gpus[1].mig_enabled
    assert (gpus[1].ecc_errors, gpus[1].remapped_rows_pending) == (3, True)
    # A query that raises leaves its field unset and the rest of the GPU intact.
    assert gpus[2].uuid is None and gpus[1].uuid == "GPU-00000000:43:00.0"


def test_power_utilisation_topology_and_p2p(tmp_path: Path) -> None:
    nvml = FakeNvml([
        FakeGpu(BUS[0], links={0: BUS[1]}, numa=0),
        FakeGpu(BUS[1], links={0: BUS[0]}, numa=0),
        FakeGpu(BUS[2], numa=1, failing={"nvmlDeviceGetPowerUsage"}),
    ])
    gpus, _ = read_gpus(nvml, tmp_path)
    assert (gpus[0].power_watts, gpus[0].utilization_percent) == (312.5, 37)
    assert gpus[2].power_watts is None, "a failing query leaves only its field unset"
    assert gpus[0].topology == {1: "SINGLE", 2: "SYSTEM"}
    assert [g.p2p_peers for g in gpus] == [[1], [0], []]


def test_gpus_on_an_nvswitch_reach_each_other(tmp_path: Path) -> None:
    nvml = FakeNvml([FakeGpu(bus, links={0: "switch", 1: "switch"}) for bus in BUS])
    profile = detect(tmp_path, nvml)
    host = profile.hosts[0]
    assert [g.nvlink_peers for g in host.gpus] == [[1, 2], [0, 2], [0, 1]]
    assert host.nvlink_all_to_all
    assert (host.driver_version, host.cuda_version) == ("570.124.06", "12.8")
    assert nvml.shut_down


def test_a_failing_nvlink_query_leaves_a_partial_mesh(tmp_path: Path) -> None:
    nvml = FakeNvml([
        FakeGpu(BUS[0], links={0: BUS[1]}),
        FakeGpu(BUS[1], links={0: BUS[0]}, failing={"nvmlDeviceGetNvLinkRemotePciInfo"}),
    ])
    host = detect(tmp_path, nvml).hosts[0]
    assert [g.nvlink_peers for g in host.gpus] == [[1], []]
    assert [g.nvlink_links for g in host.gpus] == [1, 1]
    assert not host.nvlink_all_to_all


def test_a_lost_gpu_is_reported_not_dropped_silently(tmp_path: Path) -> None:
    nvml = FakeNvml([FakeGpu(BUS[0]), FakeGpu(BUS[1], failing={"handle"})])
    host = detect(tmp_path, nvml).hosts[0]
    assert [g.index for g in host.gpus] == [0]
    assert host.gpu_errors == ["GPU 1: GPU is lost"]


def test_numa_node_falls_back_to_sysfs(tmp_path: Path) -> None:
    (tmp_path / "sys/bus/pci/devices/0000:1b:00.0").mkdir(parents=True)
    (tmp_path / "sys/bus/pci/devices/0000:1b:00.0/numa_node").write_text("1\n")
    gpus, _ = read_gpus(FakeNvml([FakeGpu(BUS[0], numa=-1), FakeGpu(BUS[1], numa=-1)]), tmp_path)
    assert [g.numa_node for g in gpus] == [1, None]


@pytest.mark.parametrize("error", ["NVML Shared Library Not Found", "Driver Not Loaded"])
def test_no_driver_means_zero_gpus(tmp_path: Path, error: str) -> None:
    host = detect(tmp_path, FakeNvml([FakeGpu(BUS[0])], init_error=error)).hosts[0]
    assert (host.gpus, host.gpu_errors, host.driver_version, host.nvlink_all_to_all) == ([], [], None, False)


def test_detect_on_this_host() -> None:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        driver = False
    else:
        driver = True
        pynvml.nvmlShutdown()
    profile = detect()
    assert profile.source == "detected"
    [host] = profile.hosts
    assert host.name == socket.gethostname()
    assert (len(host.gpus) > 0) == driver
    assert host.ram_bytes and host.ram_bytes > 0
    assert host.cpu_cores and host.cpu_cores >= 1
    assert all(nic.name != "lo" for nic in host.nics)


# --- /proc and /sys ------------------------------------------------------------------------


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def link(path: Path, target: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)


@pytest.fixture
def fake_root(tmp_path: Path) -> Path:
    """A /proc and /sys tree of a two-socket host with an SSD, an HDD, NFS, Ethernet and IB."""
    root = tmp_path / "root"
    write(root / "proc/cpuinfo", "processor\t: 0\nmodel name\t: AMD EPYC 9654 96-Core Processor\n\n"
                                 "processor\t: 1\nmodel name\t: AMD EPYC 9654 96-Core Processor\n\n")
    write(root / "proc/meminfo", "MemTotal:       16384 kB\nMemFree:         1024 kB\n")
    for node in ("node0", "node1"):
        (root / "sys/devices/system/node" / node).mkdir(parents=True)
    (root / "sys/devices/system/node/possible").write_text("0-1\n")  # not a node directory
    write(root / "proc/mounts", "\n".join([
        "/dev/sda1 /data ext4 rw,relatime 0 0",
        "/dev/sda1 /data-again ext4 rw,relatime 0 0",  # a bind mount of the same device
        "/dev/mapper/vg-root /srv xfs rw 0 0",
        "tmpfs /run tmpfs rw 0 0",
        "/dev/sdb1 /etc/hosts ext4 rw 0 0",  # a bind-mounted file
        r"srv:/export /mnt/my\040share nfs4 rw 0 0",
    ]) + "\n")
    for mount in ("data", "data-again", "srv", "run", "mnt/my share"):
        (root / mount).mkdir(parents=True)
    write(root / "etc/hosts", "")
    link(root / "dev/mapper/vg-root", "../dm-0")
    link(root / "sys/class/block/sda1", "../../devices/pci0/block/sda/sda1")
    write(root / "sys/devices/pci0/block/sda/queue/rotational", "0\n")
    (root / "sys/devices/pci0/block/sda/sda1").mkdir()
    link(root / "sys/class/block/dm-0", "../../devices/virtual/block/dm-0")
    write(root / "sys/devices/virtual/block/dm-0/queue/rotational", "1\n")
    for name, kind, speed in (("lo", "772", None), ("eth0", "1", "25000"), ("eth1", "1", "-1"),
                              ("ib0", "32", None)):
        write(root / "sys/class/net" / name / "type", kind + "\n")
        if speed:
            write(root / "sys/class/net" / name / "speed", speed + "\n")
    for device, rate, layer in (("mlx5_0", "400 Gb/sec (4X NDR)", "InfiniBand"),
                                ("mlx5_1", "100 Gb/sec (4X EDR)", "Ethernet")):
        write(root / "sys/class/infiniband" / device / "ports/1/rate", rate + "\n")
        write(root / "sys/class/infiniband" / device / "ports/1/link_layer", layer + "\n")
    return root


def test_proc_and_sys_are_read(fake_root: Path) -> None:
    host = detect(fake_root, FakeNvml([], init_error="Driver Not Loaded")).hosts[0]
    assert (host.cpu_model, host.cpu_cores) == ("AMD EPYC 9654 96-Core Processor", 2)
    assert host.ram_bytes == 16384 * 1024
    assert host.numa_nodes == 2
    assert [(d.mount, d.rotational) for d in host.disks] == [
        ("/data", False), ("/srv", True), ("/mnt/my share", None)]
    assert all(d.total_bytes >= d.free_bytes > 0 for d in host.disks)
    assert [(n.name, n.kind, n.speed_mbps) for n in host.nics] == [
        ("eth0", "ethernet", 25000), ("eth1", "ethernet", None), ("ib0", "infiniband", None),
        ("mlx5_0/1", "infiniband", 400_000), ("mlx5_1/1", "ethernet", 100_000)]


@pytest.mark.parametrize("error", [errno.ESTALE, errno.EACCES, errno.ENOTCONN, errno.ENOENT])
def test_a_mount_that_cannot_be_looked_at_is_left_out(fake_root: Path, error: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A stale NFS mount, a FUSE mount whose daemon died, one this user may not enter, or one
    unmounted since /proc/mounts was read: the other disks are still reported."""
    real_stat = os.stat

    def failing_stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if str(path).endswith("/srv"):
            raise OSError(error, os.strerror(error), str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", failing_stat)
    host = detect(fake_root, FakeNvml([], init_error="Driver Not Loaded")).hosts[0]
    assert [d.mount for d in host.disks] == ["/data", "/mnt/my share"]


def test_an_empty_tree_gives_an_empty_but_valid_host(tmp_path: Path) -> None:
    host = detect(tmp_path, FakeNvml([], init_error="Driver Not Loaded")).hosts[0]
    assert (host.cpu_cores, host.ram_bytes, host.numa_nodes) == (os.cpu_count(), None, None)
    assert (host.disks, host.nics) == ([], [])


# --- hand-written profiles -----------------------------------------------------------------


def test_example_toml_profile_loads() -> None:
    profile = load_profile(EXAMPLE)
    assert [h.name for h in profile.hosts] == ["node-a", "node-b"]
    assert all(len(h.gpus) == 8 and h.nvlink_all_to_all for h in profile.hosts)
    assert profile.hosts[1].gpus[7].nvlink_peers == [0, 1, 2, 3, 4, 5, 6]
    assert profile.source == "file"


def test_json_profile_loads(tmp_path: Path) -> None:
    path = tmp_path / "cluster.json"
    path.write_text(load_profile(EXAMPLE).model_dump_json(indent=2))
    assert load_profile(path) == load_profile(EXAMPLE)


def two_hosts() -> dict[str, Any]:
    gpu = {"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_bytes": 85_520_809_984}
    return {"hosts": [{"name": "node-a", "gpus": [dict(gpu)]}, {"name": "node-b", "gpus": [dict(gpu)]}]}


def bad_json(tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> str:
    data = two_hosts()
    edit(data)
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(data, indent=2))
    with pytest.raises(ProfileError) as caught:
        load_profile(path)
    assert str(path) in caught.value.message
    return caught.value.message


def test_missing_field_names_file_host_and_field(tmp_path: Path) -> None:
    message = bad_json(tmp_path, lambda d: d["hosts"][1]["gpus"][0].pop("memory_bytes"))
    assert "hosts.node-b.gpus[0].memory_bytes: Field required" in message


def test_wrong_type_names_the_value(tmp_path: Path) -> None:
    message = bad_json(tmp_path, lambda d: d["hosts"][0]["gpus"][0].update(memory_bytes="eighty"))
    assert "hosts.node-a.gpus[0].memory_bytes: Input should be a valid integer" in message
    assert "(got 'eighty')" in message


def test_unknown_field_is_an_error(tmp_path: Path) -> None:
    message = bad_json(tmp_path, lambda d: d["hosts"][0].update(gpu_count=8))
    assert "hosts.node-a.gpu_count: Extra inputs are not permitted" in message


def test_every_problem_is_listed(tmp_path: Path) -> None:
    def two_problems(data: dict[str, Any]) -> None:
        data["hosts"][0]["gpus"][0]["memory_bytes"] = 0
        data["hosts"][1]["nics"] = [{"name": "eth0", "speed": 100}]

    message = bad_json(tmp_path, two_problems)
    assert "hosts.node-a.gpus[0].memory_bytes: Input should be greater than 0 (got 0)" in message
    assert "hosts.node-b.nics[0].speed: Extra inputs are not permitted" in message


def test_duplicate_host_names(tmp_path: Path) -> None:
    def rename(data: dict[str, Any]) -> None:
        data["hosts"][1]["name"] = "node-a"
        data["hosts"][1]["gpus"][0]["memory_bytes"] = -1

    message = bad_json(tmp_path, rename)
    # A repeated name cannot say which host it is: the index is used instead.
    assert "hosts[1].gpus[0].memory_bytes" in message


def test_duplicate_host_names_alone(tmp_path: Path) -> None:
    message = bad_json(tmp_path, lambda d: d["hosts"][1].update(name="node-a"))
    assert "profile: host names repeat: ['node-a', 'node-a']" in message


def test_toml_syntax_error_gives_the_line(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text('[[hosts]]\nname = "node-a"\ngpus = [ { index = 0, name = } ]\n')
    with pytest.raises(ProfileError, match=rf"^{path}:3: not valid TOML"):
        load_profile(path)


def test_toml_validation_error(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text('[[hosts]]\nname = "node-a"\ngpus = [ { index = 0, name = "L4" } ]\n')
    with pytest.raises(ProfileError, match=r"hosts\.node-a\.gpus\[0\]\.memory_bytes: Field required"):
        load_profile(path)


@pytest.mark.parametrize(("name", "text", "expected"), [
    ("cluster.json", '{"hosts": [\n  {"name": }\n]}', r"cluster\.json:2: not valid JSON"),
    ("cluster.yaml", "hosts: []", "unknown profile format '.yaml'"),
    ("missing.json", None, "cannot read the profile"),
])
def test_unreadable_files(tmp_path: Path, name: str, text: str | None, expected: str) -> None:
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(ProfileError, match=expected):
        load_profile(path)


# --- shorthand -----------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "hosts", "gpus", "name", "gib", "nvlink"), [
    ("2x8xH100-80GB", 2, 8, "H100", 80, True),
    ("1x8xH200-141GB", 1, 8, "H200", 141, True),
    ("4x8xA100-40GB", 4, 8, "A100", 40, True),
    ("1x1xL4-24GB", 1, 1, "L4", 24, False),
    ("1x1xH100-80GB", 1, 1, "H100", 80, False),  # one GPU: no NVLink peers to reach
    ("1x4xL40S-48GB", 1, 4, "L40S", 48, False),
    ("1x4xRTX-6000-48GiB", 1, 4, "RTX-6000", 48, False),
])
def test_spec(spec: str, hosts: int, gpus: int, name: str, gib: int, nvlink: bool) -> None:
    profile = parse_hardware_spec(spec)
    assert profile.source == "spec"
    assert [h.name for h in profile.hosts] == [f"node-{n}" for n in range(hosts)]
    for host in profile.hosts:
        assert [g.index for g in host.gpus] == list(range(gpus))
        assert {(g.name, g.memory_bytes) for g in host.gpus} == {(name, gib * 2**30)}
        assert host.nvlink_all_to_all == nvlink
        assert all(len(g.nvlink_peers) == (gpus - 1 if nvlink else 0) for g in host.gpus)


@pytest.mark.parametrize("spec", ["8xH100-80GB", "2x8xH100", "2x8xH100-80TB", "0x8xH100-80GB",
                                  "2x0xH100-80GB", "2x8xH100-0GB", "two x8xH100-80GB", ""])
def test_bad_spec(spec: str) -> None:
    with pytest.raises(ProfileError) as caught:
        parse_hardware_spec(spec)
    line = caught.value.one_line()
    assert repr(spec) in line
    assert "HOSTSxGPUSxNAME-MEMORY" in line and "2x8xH100-80GB" in line
