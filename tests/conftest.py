"""Shared fixtures: the demo model and Keycloak that the set-up step installed. Helpers that
tests and benches share live in tests/support/."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from appliance.home import Home
from installer.keycloak_dist import install_dir
from tests.lanes import LaneScheduling
from tests.support.session import stop_session_appliance
from tests.support.shared import SHARED_ENV, WAITS, locked, shared_dir

pytest_plugins = ["tests.module_times"]  # each module's wall time at the end of a run

ROOT = Path(__file__).parents[1]
INTEGRATION = ROOT / "tests" / "integration"

# The suite runs on two pytest-xdist workers (pyproject.toml's addopts), a module at a time each,
# in this order (a folder stands for its modules; those named nowhere come last), each worker
# taking the next module pinned to it in LANES or pinned to neither (tests/lanes.py), so that a
# module rarely waits for another's lock (tests/integration/conftest.py; each module's wait is in
# the report at the end of a run). Minutes are from a full run on 2 cores:
# - first, integration modules side by side: on worker 0 the sharded trainer (10), over hosts,
#   the training network, the bundle (10) and the cluster (4); on worker 1 the RL loop (20),
#   adapters and the training worker (6);
# - then the modules marked `alone` (engines of their own) on worker 0: tiers (6), PostgreSQL (5),
#   backup (9), the dependency alerts (4), while worker 1 runs the unit tests, which take no lock
#   (23), the one that trains models last, once the tiers module's engines are gone (memory);
# - then either worker: the modules that share the session appliance, and last each module that
#   has the session appliance to itself (it stops or restarts its parts, or counts what reaches
#   it) next to one that does not use it.
RUN_ORDER = [
    "tests/integration/test_execution_feedback.py",
    "tests/integration/test_finetune_sharded.py",
    "tests/integration/test_finetune_multinode.py",
    "tests/integration/test_training_network.py",
    "tests/integration/test_bundle_install.py",
    "tests/integration/test_cluster.py",
    "tests/integration/test_adapters.py",
    "tests/integration/test_finetune_worker.py",
    "tests/integration/test_gateway_tiers.py",
    "tests/unit/",
    "tests/unit/test_backup.py",
    "tests/unit/test_tui.py",
    "tests/integration/test_keycloak_postgres.py",
    "tests/integration/test_backup.py",
    "tests/integration/test_dependency_alerts.py",
    "tests/unit/test_finetune.py",
    "tests/integration/test_canary.py",
    "tests/integration/test_planner_vllm.py",
    "tests/integration/test_api_keys.py",
    "tests/integration/test_gateway_fuzz.py",
    "tests/integration/test_keycloak_logins.py",
    "tests/integration/test_compliance_filter.py",
    "tests/integration/test_admin.py",
    "tests/integration/test_admin_tui.py",
    "tests/integration/test_lifecycle.py",
    "tests/integration/test_sharded_state.py",
    "tests/integration/test_audit_trail.py",
    "tests/integration/test_lifecycle_errors.py",
    "tests/integration/test_lifecycle_resume.py",
    "tests/integration/test_day_one.py",
    "tests/integration/test_attacks.py",
    "tests/integration/test_tool_calls.py",
    "tests/integration/test_exec_sandbox.py",
    "tests/integration/test_network.py",
    "tests/integration/test_login_proxy.py",
    "tests/integration/test_gateway.py",
    "tests/integration/test_audit_archive_s3.py",
]
# The worker each module is pinned to (a folder: its modules, unless a module is named itself).
LANES: dict[str, int] = {
    **dict.fromkeys(["tests/integration/test_finetune_sharded.py", "tests/integration/test_finetune_multinode.py",
                     "tests/integration/test_training_network.py", "tests/integration/test_bundle_install.py",
                     "tests/integration/test_cluster.py", "tests/integration/test_gateway_tiers.py",
                     "tests/integration/test_keycloak_postgres.py", "tests/integration/test_backup.py",
                     "tests/integration/test_dependency_alerts.py"], 0),
    **dict.fromkeys(["tests/integration/test_execution_feedback.py", "tests/integration/test_adapters.py",
                     "tests/integration/test_finetune_worker.py", "tests/unit/"], 1),
}


def lane(module: str) -> int | None:
    """The worker LANES pins `module` to (by its name, else its folder), or None."""
    if module in LANES:
        return LANES[module]
    return next((worker for entry, worker in LANES.items() if entry.endswith("/") and module.startswith(entry)), None)


OWN_SHARED_DIR = pytest.StashKey[bool]()  # this run made the shared directory, and so removes it

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
    if not hasattr(config, "workerinput") and SHARED_ENV not in os.environ:
        # The run's main process: its workers inherit the directory. One given by the caller is
        # theirs, with the session appliance in it kept running between runs (see docs).
        os.environ[SHARED_ENV] = tempfile.mkdtemp(prefix="tests-shared-")
        config.stash[OWN_SHARED_DIR] = True
    if not hasattr(config, "workerinput"):  # a kept directory's waits are an earlier run's
        (shared_dir() / WAITS).unlink(missing_ok=True)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> LaneScheduling | None:
    """Whole modules a worker at a time, in RUN_ORDER, as LANES pins them (plain loadfile otherwise)."""
    return LaneScheduling(config, log, lane) if config.getoption("dist") == "loadfile" else None


def pytest_unconfigure(config: pytest.Config) -> None:
    """The run's main process stops the session appliance its workers shared (the worker that
    started it cannot: another may still use it) and removes the shared directory."""
    if hasattr(config, "workerinput") or not config.stash.get(OWN_SHARED_DIR, False):
        return
    stop_session_appliance()
    shutil.rmtree(shared_dir(), ignore_errors=True)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The fast loop deselects everything under tests/integration/: it does not import it either."""
    if fast_loop(config) and collection_path.is_relative_to(INTEGRATION):
        return True
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/integration/ is an integration test (unit tests that start
    processes carry the marker themselves); modules run in RUN_ORDER."""
    for item in items:
        if item.path.is_relative_to(INTEGRATION):
            item.add_marker(pytest.mark.integration)
    items.sort(key=lambda item: slowness(item.path.relative_to(ROOT).as_posix()))


def slowness(module: str) -> int:
    """A module's place in RUN_ORDER: where it is named, else where its folder is, else last."""
    if module in RUN_ORDER:
        return RUN_ORDER.index(module)
    folders = [place for place, entry in enumerate(RUN_ORDER) if entry.endswith("/") and module.startswith(entry)]
    return folders[0] if folders else len(RUN_ORDER)


@pytest.fixture(autouse=True)
def user_config(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's user configuration directory (cached logins, a remote appliance chosen), never
    the real user's."""
    path = tmp_path_factory.mktemp("config")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(path))
    return path


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


@pytest.fixture(scope="module")
def sandbox_users_to_itself() -> Iterator[None]:
    """The execution sandbox's users for this module alone, while the other workers wait: a module
    that asserts no process of an execution's user is left on the host (test_exec_sandbox) must not
    run while another starts executions (test_execution_feedback's RL run)."""
    with locked("sandbox-users", exclusive=True):
        yield
