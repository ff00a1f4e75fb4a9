"""`appliance rl tasks make` on a small package made here (its tests plain functions, one file
importing pytest, which the sandbox has not): every task it keeps, checked again in the sandbox
apart from the maker, fails its tests with the bug and passes them with the file as it was; the
set is stored as repository tasks; a source with no test that catches anything is refused."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from appliance.artifacts import artifact_store
from appliance.home import Home
from appliance.rl.tasks import load_tasksets
from appliance.settings import ExecutionSettings, load_settings
from finetune.rl.execute import Sandbox
from finetune.rl.tasks import load_repository
from tests.support.appliances import APPLIANCE

SHOP = '''\
"""A small shop."""


def total(prices, discount=0):
    if discount < 0:
        raise ValueError("a discount is not negative")
    return sum(prices) - discount


def cheapest(prices):
    best = None
    for price in prices:
        if best is None or price < best:
            best = price
    return best


def is_free(price):
    return price == 0


def label(price):
    return f"{price} EUR" if price > 0 else "free"
'''
TESTS = '''\
from shop import cheapest, is_free, label, total


def test_total():
    assert total([1, 2, 3]) == 6
    assert total([10], 4) == 6


def test_negative_discount():
    try:
        total([1], -1)
    except ValueError:
        return
    raise AssertionError("no error")


def test_cheapest():
    assert cheapest([3, 1, 2]) == 1 and cheapest([]) is None


def test_free():
    assert is_free(0) and not is_free(1)
    assert label(0) == "free" and label(2) == "2 EUR"
'''


def check(files: dict[str, str], test_file: str) -> tuple[int, int]:
    with Sandbox(ExecutionSettings(), workspace_mib=8) as sandbox:
        assert sandbox.act("seed", files=files).status == "passed"
        verdict = sandbox.act("check", files={test_file: files[test_file]})
    return verdict.tests_passed, verdict.tests_total


@pytest.mark.integration
def test_made_tasks_fail_with_their_bug_and_pass_without_it(tmp_path: Path) -> None:
    repository = tmp_path / "repo"
    (repository / "shop").mkdir(parents=True)
    (repository / "shop" / "__init__.py").write_text(SHOP)
    (repository / "tests").mkdir()
    (repository / "tests" / "test_shop.py").write_text(TESTS)
    (repository / "tests" / "test_pytest_only.py").write_text("import pytest\n\n\ndef test_total():\n    pass\n")
    home = Home(tmp_path / "home").ensure()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}, "APPLIANCE_HOME": str(home.root)}
    made = subprocess.run([APPLIANCE, "rl", "tasks", "make", "--from", str(repository), "--name", "shop-bugs",
                           "--limit", "4"], env=env, capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stderr
    assert "bugs kept" in made.stdout
    [info] = load_tasksets(home).values()
    assert info.kind == "repository" and 1 <= info.tasks <= 4
    tasks = load_repository("shop-bugs", "all", artifact_store(load_settings(home.settings_file).artifacts, home), home)
    assert len(tasks) == info.tasks
    for task in tasks:
        assert task.tests == ["tests/test_shop.py"]  # the file importing pytest was never used
        assert task.files["shop/__init__.py"] != SHOP and task.id.startswith("repo-")
        assert task.instruction.startswith("A test of repo fails: tests/test_shop.py::")
        passed, total = check(task.files, "tests/test_shop.py")
        assert passed < total, task.id
        assert check({**task.files, "shop/__init__.py": SHOP}, "tests/test_shop.py") == (total, total), task.id

    # A source whose tests catch nothing (they call no function of it) gives no task: refused, nothing stored.
    (repository / "tests" / "test_shop.py").write_text("def test_nothing():\n    assert True\n")
    refused = subprocess.run([APPLIANCE, "rl", "tasks", "make", "--from", str(repository), "--name", "none"],
                             env=env, capture_output=True, text=True, timeout=600)
    assert refused.returncode != 0 and "none of 0 bugs made a test fail" in refused.stderr
    assert "none" not in load_tasksets(home)
