"""A real supervisord running a real vLLM serving the demo model: started once per session."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import Appliance, make_appliance


@dataclass
class Running:
    appliance: Appliance
    up_output: str
    up_seconds: float


@pytest.fixture(scope="session")
def running(demo_model: Path) -> Iterator[Running]:
    for appliance in make_appliance(demo_model):
        started = time.monotonic()
        result = appliance.run("up")
        assert result.returncode == 0, result.stdout + result.stderr
        yield Running(appliance, result.stdout, time.monotonic() - started)
