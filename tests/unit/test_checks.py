"""The checks .ci/run runs before the tests are strict: a type error and a lint error each fail
them (the configuration in pyproject.toml, not a looser one, is what CI uses)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run(tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(Path(sys.executable).with_name(tool)), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def test_ci_runs_the_linter_and_the_type_checker() -> None:
    script = (REPO / ".ci" / "run").read_text()
    assert ".venv/bin/ruff check ." in script and "\n.venv/bin/mypy" in script and "set -euo pipefail" in script


def test_the_type_checker_covers_every_package_and_the_benches() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = {path.parent.name for path in REPO.glob("*/__init__.py")} - {"tests"}
    assert packages >= {"appliance", "serve", "audit", "installer", "finetune", "tui", "bench"}
    assert set(config["tool"]["mypy"]["files"]) == packages
    assert not {"bench", *packages} & set(config["tool"]["ruff"].get("extend-exclude", []))


@pytest.mark.integration
def test_a_type_error_fails_the_type_check(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def half(n):\n    return n / 2\n\n\ncount: int = 'three'\n")
    checked = run("mypy", "--config-file", "pyproject.toml", str(bad))
    assert checked.returncode == 1, checked.stdout
    assert "Function is missing a type annotation" in checked.stdout  # strict: untyped defs are errors
    assert '(expression has type "str", variable has type "int")' in checked.stdout


@pytest.mark.integration
def test_a_lint_error_fails_the_lint(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nimport sys\n\nprint(sys.argv)\n")
    linted = run("ruff", "check", "--config", str(REPO / "pyproject.toml"), str(bad))
    assert linted.returncode == 1 and "F401" in linted.stdout, linted.stdout
