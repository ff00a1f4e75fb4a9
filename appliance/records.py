"""Typed records shared between packages: the hardware profile (detected on this host or written
by hand for a cluster) and the parallelism plan made for it."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from appliance.errors import ApplianceError

STAGING_MANIFEST = "staging-manifest.json"  # in a staged directory, written by `appliance stage`
PLAN_MAX_BYTES = 16 << 20  # a plan for 64 hosts of 256 GPUs is 2.5 MB (11 000 layouts rejected)


def read_regular_file(path: Path, max_bytes: int) -> bytes:
    """The bytes of a regular file of at most `max_bytes` (a link is followed: Hugging Face caches
    link config.json to a blob). OSError if it cannot be opened, is not a regular file (a FIFO is
    not waited on, a device not read without end) or holds more (its strerror says which)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as handle:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        if found.st_size > max_bytes:
            raise OSError(errno.EFBIG, f"{found.st_size} bytes, over the limit of {max_bytes}", str(path))
        data = handle.read(max_bytes + 1)  # a file growing, or a /proc file that says size 0
    if len(data) > max_bytes:
        raise OSError(errno.EFBIG, f"over the limit of {max_bytes} bytes", str(path))
    return data


def config_sha256(config: dict[str, Any]) -> str:
    """A model's identity for plans and adapters: SHA-256 of its config.json, keys sorted."""
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Gpu(_Record):
    index: int = Field(ge=0)
    name: str = Field(description="e.g. 'NVIDIA H100 80GB HBM3'.")
    memory_bytes: int = Field(gt=0)
    uuid: str | None = None
    pci_bus_id: str | None = None
    compute_capability: str | None = Field(None, description="e.g. '9.0'.")
    numa_node: int | None = None
    nvlink_peers: list[int] = Field(default_factory=list, description="Indexes of GPUs reached by NVLink.")
    nvlink_links: int = Field(0, ge=0, description="Active NVLink links.")
    mig_enabled: bool = False
    ecc_errors: int = Field(0, ge=0, description="Uncorrected ECC errors (volatile).")
    remapped_rows_pending: bool = False
    power_watts: float | None = None
    utilization_percent: int | None = None
    p2p_peers: list[int] = Field(default_factory=list, description="GPUs it can reach peer-to-peer over NVLink.")
    topology: dict[int, str] = Field(
        default_factory=dict, description="Common ancestor with each other GPU: INTERNAL, SINGLE, MULTIPLE, "
        "HOSTBRIDGE, NODE or SYSTEM (nvidia-smi topo's levels).")


class Disk(_Record):
    mount: str
    free_bytes: int = Field(ge=0)
    total_bytes: int = Field(ge=0)
    rotational: bool | None = None


class Nic(_Record):
    name: str
    kind: str = Field("ethernet", description="'ethernet' or 'infiniband'.")
    speed_mbps: int | None = None


# A host's name becomes a directory (staged weights per host): letters and digits joined by
# single '.', '-' or '_', so never '..', '/' or a leading dot.
CpuList = Annotated[str, Field(pattern=r"^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*$", max_length=4096)]
HostName = Annotated[str, Field(pattern=r"^[A-Za-z0-9]+([._-][A-Za-z0-9]+)*$", max_length=253)]


class Host(_Record):
    name: HostName
    gpus: list[Gpu] = Field(default_factory=list, max_length=256)
    nvlink_all_to_all: bool = Field(
        False, description="Every GPU reaches every other over NVLink/NVSwitch (one TP domain).")
    gpu_errors: list[str] = Field(
        default_factory=list,
        description="GPUs the driver lists but could not be read (e.g. fallen off the bus), with why.")
    driver_version: str | None = None
    cuda_version: str | None = Field(None, description="The driver's CUDA version, e.g. '12.8'.")
    cpu_model: str | None = None
    cpu_cores: int | None = Field(None, ge=1)
    ram_bytes: int | None = Field(None, ge=0)
    numa_nodes: int | None = Field(None, ge=1)
    numa_cpus: dict[int, CpuList] = Field(default_factory=dict, description="Each NUMA node's CPUs, e.g. '0-23,48-71'.")
    disks: list[Disk] = Field(default_factory=list)
    nics: list[Nic] = Field(default_factory=list)

    @model_validator(mode="after")
    def _gpu_indexes_distinct(self) -> Host:
        indexes = [gpu.index for gpu in self.gpus]
        if len(set(indexes)) != len(indexes):
            raise ValueError(f"host {self.name!r}: GPU indexes repeat: {indexes}")
        return self


class HardwareProfile(_Record):
    """One host (detected) or a cluster (written by hand, one entry per host)."""

    hosts: list[Host] = Field(min_length=1, max_length=1024)
    source: str = Field("file", description="'detected', 'file' or 'spec'.")

    @model_validator(mode="after")
    def _host_names_distinct(self) -> HardwareProfile:
        names = [host.name for host in self.hosts]
        if len(set(names)) != len(names):
            raise ValueError(f"host names repeat: {names}")
        return self


class PlanLayout(_Record):
    tp: int = Field(ge=1)
    pp: int = Field(ge=1)
    dp: int = Field(ge=1)
    ep: bool
    gpus: int = Field(ge=1)
    hosts: int = Field(ge=1)

    @model_validator(mode="after")
    def _gpus_add_up(self) -> PlanLayout:
        if self.gpus != self.tp * self.pp * self.dp:
            raise ValueError(f"gpus {self.gpus} is not tp x pp x dp ({self.tp} x {self.pp} x {self.dp})")
        if self.gpus % self.hosts:
            raise ValueError(f"hosts {self.hosts} does not divide gpus {self.gpus}")
        return self


class PlanModel(_Record):
    name: str
    config_sha256: str
    architecture: str
    total_params: int
    active_params: int
    format: str
    layers: int
    quantization: Literal["fp8", "bitsandbytes"] | None = Field(
        None, description="vLLM --quantization, where the weights are quantized online from a 16- or 32-bit "
        "checkpoint (fp8, or nf4 as bitsandbytes); a 16-bit float format is the launch's --dtype instead.")


class PlanHardware(_Record):
    hosts: int
    gpus_per_host: int
    gpu: str
    gpu_memory_bytes: int
    nvlink: bool


class SpeculativeConfig(_Record):
    """vLLM's --speculative-config for a plan (config/speculative.py): the model's own MTP layers,
    or a draft model."""

    method: Literal["mtp", "draft_model"]
    num_speculative_tokens: int = Field(ge=1, le=64)
    model: str | None = Field(None, min_length=1, max_length=4096, pattern=r"^[^\x00-\x1f\x7f]+$",
                              description="The draft model's directory (draft_model only).")

    @model_validator(mode="after")
    def _draft_named(self) -> SpeculativeConfig:
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("a draft model's directory goes with method draft_model, and only with it")
        return self


class PlanTarget(_Record):
    context: int = Field(ge=1, le=2**31)
    concurrency: int = Field(ge=1)
    speculative: SpeculativeConfig | None = Field(
        None, description="What speculative decoding the memory was planned for (its launch passes it to vLLM).")


class PerGpuBytes(_Record):
    weights: int
    kv_cache: int
    reserve: int
    budget: int


class RejectedLayout(_Record):
    layout: PlanLayout
    reason: str


class AlternativeLayout(_Record):
    layout: PlanLayout
    kv_capacity_tokens: int


class HostCommand(_Record):
    host: HostName
    role: str = Field(description="'head' or 'worker'.")
    argv: list[str]
    env: dict[str, str]
    gpus: list[int] = Field(default_factory=list, description="GPU indexes its ranks hold on that host.")


class SmallestHardware(_Record):
    hosts: int
    gpus_per_host: int
    gpu: str
    layout: PlanLayout


class Plan(_Record):
    """A layout for a model on some hardware, why, and how to launch it (`appliance plan --json`)."""

    model: PlanModel
    hardware: PlanHardware
    target: PlanTarget
    feasible: bool
    rejected: list[RejectedLayout] = Field(max_length=100_000)
    objective: Literal["capacity", "min-gpus"] = Field(
        "min-gpus", description="What chose the layout: 'capacity' (the most KV-cache tokens, then fewer hosts, "
        "then less traffic between hosts) or 'min-gpus' (the fewest GPUs; plan files from before the objective).")
    choice: str | None = Field(None, description="Why the chosen layout won, in numbers against the runner-up.")
    runner_up: AlternativeLayout | None = None
    layout: PlanLayout | None = None
    per_gpu: PerGpuBytes | None = None
    kv_bytes_per_token: int | None = None
    kv_capacity_tokens: int | None = None
    max_concurrent_sequences: int | None = None
    alternatives: list[AlternativeLayout] = Field(default_factory=list, max_length=100_000)
    commands: list[HostCommand] = Field(default_factory=list, max_length=1024)
    notes: list[str] = Field(default_factory=list)
    smallest_fitting_hardware: SmallestHardware | None = None


def load_plan(path: Path, where: str, error: type[ApplianceError] = ApplianceError) -> Plan:
    """The plan record in `path`; `error` (naming `where`) if it cannot be read or is not one."""
    try:
        return Plan.model_validate_json(read_regular_file(path, PLAN_MAX_BYTES))
    except OSError as exc:
        raise error(f"{where}: cannot read the plan: {exc.strerror or exc}") from exc
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(map(str, first["loc"]))  # none for a file that is not JSON at all
        message = str(first["msg"]).removeprefix("Value error, ")
        raise error(f"{where}: not a plan record: {field + ': ' if field else ''}{message}",
                    hint="write one with `appliance plan MODEL ... --json > FILE`") from exc
