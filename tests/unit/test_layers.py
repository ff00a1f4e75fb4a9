"""The packages' layering, stated twice and held to itself: the design docs' table (what each package
imports) and import-linter's contracts in pyproject.toml, which `lint-imports` checks in CI, say the
same; the layers run downwards, so the table has no cycle; the tree keeps the contracts; and the
contracts bite: a copy of the tree with an import planted against every rule, and the installer's
old Keycloak circle planted back, fails `lint-imports`, which names each planted import and the
circle."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from itertools import cycle
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"appliance", "audit", "serve", "installer", "finetune", "tui"}
DOC = ROOT / "docs" / "design" / "architecture.md"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
REPORTED = re.compile(r"^[-\s]*([\w.]+) -> ([\w.]+) \(l\.\d+", re.M)
# The ways code imports a module, each of which the contracts must see: plain, from, inside a
# function (run later), and for type checking only.
PLANTS = (
    "import {target}\n",
    "from {package} import {leaf}\n",
    "def later() -> None:\n    import {target}\n",
    "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    import {target}\n",
)


def importlinter() -> dict[str, Any]:
    section: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return section


def allowed_by_contracts() -> dict[str, set[str]]:
    """What each package may import of the others: all but what its forbidden contract names."""
    allowed: dict[str, set[str]] = {}
    for contract in importlinter()["contracts"]:
        if contract["type"] == "forbidden":
            [source] = contract["source_modules"]
            assert source not in allowed, f"two forbidden contracts for {source}"
            allowed[source] = PACKAGES - {source} - set(contract["forbidden_modules"])
    return allowed


def allowed_by_docs() -> dict[str, set[str]]:
    """What each package imports, as the design docs' "Packages" table says (its last column)."""
    section = DOC.read_text().split("\n## Packages\n", 1)[1].split("\n## ", 1)[0]
    allowed: dict[str, set[str]] = {}
    for row in re.findall(r"^\| `(\w+)/` \|.*\| ([^|]*) \|$", section, re.M):
        package, imports = row
        if package in PACKAGES:
            allowed[package] = set(re.findall(r"`(\w+)`", imports)) & PACKAGES
    return allowed


def layers() -> list[set[str]]:
    """The layers contract's layers, top first; siblings of a layer as a set."""
    [contract] = [c for c in importlinter()["contracts"] if c["type"] == "layers"]
    return [{name.strip() for name in re.split(r"[|:]", layer)} for layer in contract["layers"]]


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    """`lint-imports` as CI runs it, on the packages under `tree` (they come first on the path)."""
    environment = {**os.environ, "PYTHONPATH": str(tree), "COLUMNS": "500"}  # no wrapped lines
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=tree, env=environment, capture_output=True,
                          text=True, timeout=300, check=False)


def test_the_docs_table_and_the_contracts_state_the_same_imports() -> None:
    assert set(importlinter()["root_packages"]) == PACKAGES
    assert allowed_by_docs() == allowed_by_contracts()
    assert allowed_by_docs().keys() == PACKAGES  # a row per package, a contract per package


def test_every_allowed_import_runs_down_the_layers_so_none_closes_a_cycle() -> None:
    floors = layers()
    assert sorted(name for layer in floors for name in layer) == sorted(PACKAGES)
    floor = {name: index for index, layer in enumerate(floors) for name in layer}
    for source, targets in allowed_by_contracts().items():
        for target in targets:
            assert floor[source] < floor[target], f"{source} may import {target}, which is not below it"


def test_the_tree_keeps_the_contracts() -> None:
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_an_import_planted_against_any_rule_fails_ci_and_is_named(tmp_path: Path) -> None:
    for package in sorted(PACKAGES):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    clean = lint_imports(tmp_path)
    assert clean.returncode == 0, clean.stdout + clean.stderr  # the copy alone breaks nothing

    allowed = allowed_by_contracts()
    forbidden = sorted((source, target) for source in PACKAGES for target in PACKAGES - allowed[source] - {source})
    planted: set[tuple[str, str]] = set()
    for (source, package), plant in zip(forbidden, cycle(PLANTS), strict=False):
        leaf = min(path.stem for path in (tmp_path / package).glob("*.py") if path.stem != "__init__")
        module = f"planted_{package}"
        (tmp_path / source / f"{module}.py").write_text(
            plant.format(target=f"{package}.{leaf}", package=package, leaf=leaf))
        planted.add((f"{source}.{module}", f"{package}.{leaf}"))
    assert len(planted) == len(PACKAGES) * (len(PACKAGES) - 1) - sum(map(len, allowed.values()))
    with (tmp_path / "installer" / "keycloak_dist.py").open("a") as dist:  # it is imported by installer.keycloak
        dist.write("\nfrom installer import keycloak  # noqa: E402\n")

    broken = lint_imports(tmp_path)
    assert broken.returncode != 0  # CI stops here
    assert planted <= set(REPORTED.findall(broken.stdout)), broken.stdout
    assert "No cycles are allowed in installer." in broken.stdout
    for contract in importlinter()["contracts"]:
        assert f"{contract['name']} BROKEN" in broken.stdout
