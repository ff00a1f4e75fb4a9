"""Shared fixtures: the demo model and Keycloak that the set-up step installed. Helpers that
tests and benches share live in tests/support/."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings

from appliance.home import Home
from installer.keycloak import install_dir

pytest_plugins = ["tests.module_times"]  # each module's wall time at the end of a run

INTEGRATION = Path(__file__).parent / "integration"

# Generated examples per property test: a full run checks many; the fast loop (-m "not
# integration") fewer, so that it stays quick. --hypothesis-profile chooses either explicitly.
settings.register_profile("thorough", max_examples=150)
settings.register_profile("quick", max_examples=20)


def fast_loop(config: pytest.Config) -> bool:
    """Whether this run leaves the integration tests out (-m "not integration")."""
    return "not integration" in (config.getoption("markexpr", "") or "")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("hypothesis_profile", None) is None:
        settings.load_profile("quick" if fast_loop(config) else "thorough")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The fast loop deselects everything under tests/integration/: it does not import it either."""
    if fast_loop(config) and collection_path.is_relative_to(INTEGRATION):
        return True
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/integration/ is an integration test (unit tests that start
    processes carry the marker themselves)."""
    for item in items:
        if item.path.is_relative_to(INTEGRATION):
            item.add_marker(pytest.mark.integration)


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
