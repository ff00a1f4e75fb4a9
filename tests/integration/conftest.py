"""The whole appliance, for real: supervisord running Keycloak, vLLM serving the demo model and
the gateway, started once per session and shared by the integration tests."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import Appliance, make_appliance

# Session settings the gateway tests rely on: a small per-user budget for role `user` (the
# rate-limit test), little clock leeway (the expiry test), quick re-introspection (the
# disabled-user test), and small audit files archived often (the archive test).
SESSION_SETTINGS = {
    "APPLIANCE_GATEWAY__LIMITS": "{ user = { requests_per_minute = 60, tokens_per_minute = 100000 }, "
                                 "admin = { requests_per_minute = 100000, tokens_per_minute = 10000000 } }",
    "APPLIANCE_GATEWAY__LEEWAY_S": "1",
    "APPLIANCE_GATEWAY__INTROSPECT_TTL_S": "1",
    "APPLIANCE_AUDIT__MAX_FILE_BYTES": "65536",
    "APPLIANCE_AUDIT__ARCHIVE_INTERVAL_S": "2",
}


@dataclass
class Running:
    appliance: Appliance
    up_output: str
    up_seconds: float


@pytest.fixture(scope="session")
def running(demo_model: Path, keycloak_dist: Path) -> Iterator[Running]:
    for appliance in make_appliance(demo_model, keycloak_dist, **SESSION_SETTINGS):
        started = time.monotonic()
        result = appliance.run("up")
        assert result.returncode == 0, result.stdout + result.stderr
        yield Running(appliance, result.stdout, time.monotonic() - started)
