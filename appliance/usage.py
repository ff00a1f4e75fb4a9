"""Live host usage for the dashboards: each GPU's utilisation, memory and temperature from NVML,
and CPU and memory from the OS (the only figures on a host without GPUs)."""

from __future__ import annotations

import os
from typing import Any

import psutil
import pynvml
from pydantic import BaseModel


class GpuUsage(BaseModel):
    index: int
    name: str
    utilization_percent: int
    memory_used_bytes: int
    memory_total_bytes: int
    temperature_c: int | None


class HostUsage(BaseModel):
    cpu_percent: float
    cpu_count: int
    load_1m: float
    memory_used_bytes: int
    memory_total_bytes: int
    gpus: list[GpuUsage]
    gpu_error: str | None = None  # why there are no GPU figures (no driver, NVML failed)


def host_usage() -> HostUsage:
    """A snapshot; CPU percent is since the previous call in this process (0.0 the first time)."""
    memory = psutil.virtual_memory()
    gpus, error = _gpus()
    return HostUsage(cpu_percent=psutil.cpu_percent(interval=None), cpu_count=os.cpu_count() or 1,
                     load_1m=os.getloadavg()[0], memory_used_bytes=memory.total - memory.available,
                     memory_total_bytes=memory.total, gpus=gpus, gpu_error=error)


def _gpus() -> tuple[list[GpuUsage], str | None]:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return [], f"NVML unavailable: {exc}"
    try:
        return [_gpu(index, pynvml.nvmlDeviceGetHandleByIndex(index))
                for index in range(pynvml.nvmlDeviceGetCount())], None
    except pynvml.NVMLError as exc:
        return [], f"NVML query failed: {exc}"
    finally:
        pynvml.nvmlShutdown()


def _gpu(index: int, handle: Any) -> GpuUsage:
    name = pynvml.nvmlDeviceGetName(handle)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    try:
        temperature: int | None = pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
    except pynvml.NVMLError:
        temperature = None  # some boards (and MIG slices) do not report it
    return GpuUsage(index=index, name=name.decode() if isinstance(name, bytes) else name,
                    utilization_percent=pynvml.nvmlDeviceGetUtilizationRates(handle).gpu,
                    memory_used_bytes=memory.used, memory_total_bytes=memory.total, temperature_c=temperature)
