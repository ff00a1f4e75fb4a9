"""Shared fixtures: the demo model and Keycloak that the set-up step installed. Helpers that
tests and benches share live in tests/support/."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.home import Home
from installer.keycloak import install_dir

pytest_plugins = ["tests.module_times"]  # each module's wall time at the end of a run


@pytest.fixture(scope="session")
def demo_model() -> Path:
    """The demo model the set-up step prepared in the default state directory."""
    path = Home.from_env().demo_model
    if not (path / "manifest.json").exists():
        pytest.fail(f"demo model missing at {path}: run ./bootstrap.sh --no-start first")
    return path


@pytest.fixture(scope="session")
def keycloak_dist() -> Path:
    """The Keycloak distribution the set-up step installed in the default state directory."""
    path = install_dir(Home.from_env())
    if not (path / "bin" / "kc.sh").is_file():
        pytest.fail(f"Keycloak missing at {path}: run ./bootstrap.sh --no-start first")
    return path
