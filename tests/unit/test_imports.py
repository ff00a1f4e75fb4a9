"""What each entry point imports, checked in a fresh interpreter: an engine rank, the cluster agent
and the batch worker run without the gateway, and the CLI lists its commands and answers `status`
without importing the packages that contribute them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from appliance import cli

pytestmark = pytest.mark.integration  # every test here starts a fresh interpreter

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("serve", "installer", "finetune", "audit", "tui")
GATEWAY = ("serve.gateway", "fastapi", "aiohttp")


def imported_by(code: str, *args: str, env: dict[str, str] | None = None) -> tuple[set[str], str]:
    """The modules loaded after running `code` in a fresh interpreter, and what it printed."""
    report = "import json, sys; print(json.dumps(sorted(sys.modules)), file=sys.stderr)"
    script = f"import sys\ntry:\n    {code}\nexcept SystemExit:\n    pass\n{report}\n"
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, **(env or {})}, check=True)
    return set(json.loads(done.stderr.strip().splitlines()[-1])), done.stdout


def tops(modules: set[str]) -> set[str]:
    return {name.partition(".")[0] for name in modules}


@pytest.mark.parametrize(("module", "kept_out"), [
    ("serve.vllm_rank", GATEWAY),
    ("serve.cluster_agent", GATEWAY),
    ("serve.batch_worker", GATEWAY),
])
def test_programs_that_are_not_the_gateway_do_not_load_it(module: str, kept_out: tuple[str, ...]) -> None:
    loaded, _ = imported_by(f"import {module}")
    assert module in loaded
    assert not loaded & set(kept_out), f"{module} imports {sorted(loaded & set(kept_out))}"


def test_importing_the_cli_loads_no_command() -> None:
    loaded, _ = imported_by("import appliance.cli")
    assert not tops(loaded) & set(PACKAGES)
    assert not {"appliance.commands.lifecycle", "httpx", "fastapi", "appliance.settings"} & loaded


def test_help_lists_every_command_group_and_imports_none(tmp_path: Path) -> None:
    loaded, printed = imported_by("sys.argv[1:] = ['--help']; from appliance.cli import main; main()",
                                  env={"APPLIANCE_HOME": str(tmp_path), "COLUMNS": "200"})
    listed = {line.split()[1] for line in printed.splitlines() if line.startswith("│ ") and len(line.split()) > 2}
    assert set(cli.command_targets()) <= listed
    for group in ("up", "down", "status", "settings", "token", "users", "adapters", "serving", "hosts", "join",
                  "plan", "stage", "bundle", "data", "finetune", "rl", "audit", "tui"):
        assert group in listed
    assert not tops(loaded) & set(PACKAGES)
    assert not any(name.startswith("appliance.commands.") for name in loaded)


def test_status_with_nothing_running_loads_no_package_no_http_client_no_settings(tmp_path: Path) -> None:
    loaded, printed = imported_by("sys.argv[1:] = ['status']; from appliance.cli import main; main()",
                                  env={"APPLIANCE_HOME": str(tmp_path)})
    assert printed.strip() == "down (supervisord is not running)"
    assert not tops(loaded) & set(PACKAGES)
    assert not {"httpx", "cryptography", "fastapi"} & tops(loaded)
    assert not {"appliance.settings", "appliance.hosts"} & loaded  # their schemas: only when something runs
