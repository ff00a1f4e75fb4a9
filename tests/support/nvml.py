"""A fake NVML library (tests/support/fake_nvml.c) built for the test run: what pynvml loads on a host
without a GPU when it is named as the appliance's NVML library."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from appliance.home import HOME_ENV

SOURCE = Path(__file__).with_name("fake_nvml.c")


def build_fake_nvml(directory: Path) -> Path:
    """`directory`/libnvidia-ml.so.1, compiled from the fake's source with the system's C compiler."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc) to build the fake NVML library: install build-essential")
    library, partial = directory / "libnvidia-ml.so.1", directory / "libnvidia-ml.so.1.partial"
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(partial), str(SOURCE)], check=True)
    partial.replace(library)  # whole or not there
    return library


SCRAPE = ("import sys; from prometheus_client import CollectorRegistry, generate_latest; "
          "from appliance.home import Home; from serve.metrics import GpuCollector; "
          "registry = CollectorRegistry(); registry.register(GpuCollector(Home.from_env(), sys.argv[1] or None)); "
          "sys.stdout.write(generate_latest(registry).decode())")


def in_own_process(code: str, home: Path, library: Path | str | None) -> str:
    """What `code` writes, run with `library` as its argument in a process of its own (a process loads
    one NVML library, once) for the appliance at `home`."""
    return subprocess.run([sys.executable, "-P", "-c", code, str(library or "")], capture_output=True, text=True,
                          check=True, env={**os.environ, HOME_ENV: str(home)}).stdout


def gpu_metrics(home: Path, library: Path | str | None) -> str:
    """The gateway's GPU metrics for the appliance at `home`, read through `library`."""
    return in_own_process(SCRAPE, home, library)
