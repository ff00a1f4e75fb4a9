"""Live host usage: each GPU's figures from NVML (for the dashboards and the GPU metrics), and CPU
and memory from the OS (the only figures on a host without GPUs).

A figure a GPU does not report (the call is unsupported on the board, a MIG slice, an old driver)
is None, never a made-up number; with no NVML at all there are no GPU figures and `gpu_error`
says why.
"""

from __future__ import annotations

import ctypes
import os
import stat
from collections.abc import Callable
from typing import Any, TypeVar

import psutil
import pynvml
from pydantic import BaseModel

T = TypeVar("T")
# Clock event reasons that mean the GPU runs slower than it could (the others: idle, application
# clocks, sync boost, display clock, are normal).
SLOWDOWNS = {0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal",
             0x80: "hw_power_brake"}


class GpuUsage(BaseModel):
    index: int
    name: str
    uuid: str | None = None
    utilization_percent: int | None
    memory_used_bytes: int
    memory_total_bytes: int
    temperature_c: int | None
    power_watts: float | None = None
    ecc_corrected: int | None = None  # errors since the board was made (NVML's aggregate counters)
    ecc_uncorrected: int | None = None
    retired_pages: int | None = None  # pages retired for ECC errors (boards before Ampere)
    remapped_rows_uncorrectable: int | None = None  # rows remapped for uncorrectable errors (Ampere on)
    row_remap_failed: bool | None = None  # a remapping failed: the board needs service
    slowdowns: list[str] | None = None  # the SLOWDOWNS in effect now


class HostUsage(BaseModel):
    cpu_percent: float
    cpu_count: int
    load_1m: float
    memory_used_bytes: int
    memory_total_bytes: int
    gpus: list[GpuUsage]
    gpu_error: str | None = None  # why there are no GPU figures (no driver, NVML failed)


def host_usage(nvml_library: str | None = None) -> HostUsage:
    """A snapshot; CPU percent is since the previous call in this process (0.0 the first time)."""
    memory = psutil.virtual_memory()
    gpus, error = gpu_usage(nvml_library)
    return HostUsage(cpu_percent=psutil.cpu_percent(interval=None), cpu_count=os.cpu_count() or 1,
                     load_1m=os.getloadavg()[0], memory_used_bytes=memory.total - memory.available,
                     memory_total_bytes=memory.total, gpus=gpus, gpu_error=error)


def gpu_usage(nvml_library: str | None = None) -> tuple[list[GpuUsage], str | None]:
    """Each GPU's figures, or none and why. `nvml_library`: the NVML library to load instead of the
    loader's libnvidia-ml.so.1 (monitoring.nvml_library)."""
    try:
        _load(nvml_library)
        pynvml.nvmlInit()
    except OSError as exc:
        return [], f"NVML library {nvml_library} not loaded: {exc}"
    except pynvml.NVMLError as exc:
        return [], f"NVML unavailable: {exc}"
    try:
        return [_gpu(index, pynvml.nvmlDeviceGetHandleByIndex(index))
                for index in range(pynvml.nvmlDeviceGetCount())], None
    except pynvml.NVMLError as exc:
        return [], f"NVML query failed: {exc}"
    finally:
        pynvml.nvmlShutdown()


def _load(library: str | None) -> None:
    """pynvml loads libnvidia-ml.so.1 from the loader's path at its first call; a named library is
    loaded in its place (once: a process reads one NVML). Loading a library runs its code in this
    process, so it is loaded only where no other user could have put or swapped it: the file it
    resolves to and every directory above that are owned by root (or this user) and writable by no
    one else (a sticky directory excepted), and it is loaded from the descriptor that was checked."""
    if library is None or pynvml.nvmlLib is not None:
        return
    resolved = os.path.realpath(library)
    fd = os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        _owned(resolved, os.fstat(fd), directory=False)
        parent = os.path.dirname(resolved)
        while True:
            _owned(parent, os.stat(parent), directory=True)
            if parent == "/":
                break
            parent = os.path.dirname(parent)
        with pynvml.libLoadLock:
            if pynvml.nvmlLib is None:
                pynvml.nvmlLib = ctypes.CDLL(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


def _owned(path: str, status: os.stat_result, *, directory: bool) -> None:
    """OSError unless `path` is root's (or this user's) and no one else may change it."""
    others_write = status.st_mode & 0o022 and not (directory and status.st_mode & stat.S_ISVTX)
    if status.st_uid not in (0, os.geteuid()) or others_write:
        raise OSError(f"{path} is writable by others or owned by uid {status.st_uid}: not loaded")


def _optional(query: Callable[..., T], *args: Any) -> T | None:
    """A query the GPU may not answer (unsupported on this board or driver): None then."""
    try:
        return query(*args)
    except pynvml.NVMLError:
        return None


def _text(value: str | bytes | None) -> str | None:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _gpu(index: int, handle: Any) -> GpuUsage:
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)  # no default: a GPU without memory is unusable
    utilization = _optional(pynvml.nvmlDeviceGetUtilizationRates, handle)
    power = _optional(pynvml.nvmlDeviceGetPowerUsage, handle)  # milliwatts
    ecc = {kind: _optional(pynvml.nvmlDeviceGetTotalEccErrors, handle, error_type, pynvml.NVML_AGGREGATE_ECC)
           for kind, error_type in (("corrected", pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                                    ("uncorrected", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED))}
    retired = [_optional(pynvml.nvmlDeviceGetRetiredPages, handle, cause)
               for cause in (pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
                             pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)]
    rows = _optional(pynvml.nvmlDeviceGetRemappedRows, handle)  # (corrected, uncorrected, pending, failed)
    reasons = _optional(pynvml.nvmlDeviceGetCurrentClocksEventReasons, handle)
    return GpuUsage(
        index=index, name=_text(_optional(pynvml.nvmlDeviceGetName, handle)) or "unknown",
        uuid=_text(_optional(pynvml.nvmlDeviceGetUUID, handle)),
        utilization_percent=None if utilization is None else utilization.gpu,
        memory_used_bytes=memory.used, memory_total_bytes=memory.total,
        temperature_c=_optional(pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU),
        power_watts=None if power is None else power / 1000, ecc_corrected=ecc["corrected"],
        ecc_uncorrected=ecc["uncorrected"],
        retired_pages=None if None in retired else sum(len(pages or []) for pages in retired),
        remapped_rows_uncorrectable=None if rows is None else rows[1],
        row_remap_failed=None if rows is None else bool(rows[3]),
        slowdowns=None if reasons is None else [name for bit, name in SLOWDOWNS.items() if reasons & bit])
