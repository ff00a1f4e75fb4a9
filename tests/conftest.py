"""Shared fixtures: an isolated state directory and the `appliance` command run for real."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from appliance.home import HOME_ENV, Home

APPLIANCE = str(Path(sys.executable).with_name("appliance"))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Appliance:
    """One state directory and the CLI pointed at it."""

    home: Home
    env: dict[str, str] = field(default_factory=dict)

    def run(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        return subprocess.run([APPLIANCE, *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout, check=False)


@pytest.fixture(scope="session")
def demo_model() -> Path:
    """The demo model the set-up step prepared in the default state directory."""
    path = Home.from_env().demo_model
    if not (path / "manifest.json").exists():
        pytest.fail(f"demo model missing at {path}: run ./bootstrap.sh --no-start first")
    return path


def make_appliance(demo: Path | None, **overrides: str) -> Iterator[Appliance]:
    # Short path: supervisord's unix socket lives inside it (107-byte limit).
    root = Path(tempfile.mkdtemp(prefix="ap-", dir="/tmp"))
    home = Home(root / "h").ensure()
    if demo is not None:
        home.demo_model.symlink_to(demo, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    env.update({HOME_ENV: str(home.root), "APPLIANCE_POOLS__MAIN__PORT": str(free_port()),
                "COLUMNS": "200", **overrides})
    appliance = Appliance(home=home, env=env)
    try:
        yield appliance
    finally:
        appliance.run("down", timeout=300)
        shutil.rmtree(root, ignore_errors=True)
