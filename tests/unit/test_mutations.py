"""Bugs put in on purpose (finetune.rl.mutations) and what the task maker reads of a source
(finetune.rl.task_maker), without the sandbox: each kind of mutation rewrites one expression in
place and nothing else of the file; test files are kept to the tests that call a function;
sources that cannot give tasks are refused by name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from appliance.errors import Invalid
from appliance.rl.tasks import MAX_FILES
from finetune.rl.mutations import mutations, sites
from finetune.rl.task_maker import Source, _id_part, callers, focused, source_of

CODE = '''\
# The shop's prices.
def total(prices, discount):
    """The sum, less a discount."""
    if discount < 0 or not prices:  # nothing to take off
        return 0
    return sum(prices) - discount * 1


class Basket:
    def empty(self):
        return True
'''


def test_each_kind_rewrites_one_expression_in_place() -> None:
    found = {(m.kind, m.before, m.after) for m in mutations("shop.py", CODE)}
    assert ("comparison", "discount < 0", "(discount <= 0)") in found
    assert ("boolean", "discount < 0 or not prices", "(discount < 0 and (not prices))") in found
    assert ("negation", "not prices", "(prices)") in found
    assert ("arithmetic", "sum(prices) - discount * 1", "(sum(prices) + discount * 1)") in found
    assert ("constant", "0", "1") in found and ("return", "True", "False") in found
    for mutation in mutations("shop.py", CODE):
        assert mutation.text != CODE
        assert mutation.text.startswith("# The shop's prices.\n")  # comments and docstrings stay
        assert '"""The sum, less a discount."""' in mutation.text
        changed = [(a, b) for a, b in zip(CODE.splitlines(), mutation.text.splitlines(), strict=True) if a != b]
        assert len(changed) == 1 and mutation.before in changed[0][0] and mutation.after in changed[0][1]
    assert {m.function for m in mutations("shop.py", CODE)} == {"total", "Basket.empty"}
    assert list(mutations("bad.py", "def (:\n")) == []


def test_tests_are_kept_to_those_that_call_a_function_and_need_nothing_absent() -> None:
    tests = ("import shop\n\nHELPER = 3\n\n\ndef test_total():\n    assert shop.total([HELPER], 1) == 2\n\n\n"
             "@staticmethod\ndef test_other():\n    assert True\n")
    source = Source("shop", {"shop.py": CODE, "test_shop.py": tests,
                             "test_needs_pytest.py": "import pytest\n\ndef test_x():\n    shop.total([], 0)\n"},
                    ["test_shop.py", "test_needs_pytest.py"])
    assert callers(source)["total"] == {"test_shop.py": ["test_total"]}  # pytest is not in the sandbox
    kept = focused(tests, ["test_total"])
    assert "HELPER = 3" in kept and "def test_total" in kept and "test_other" not in kept
    assert "@staticmethod" not in kept


def test_sources_that_cannot_give_tasks_are_refused(tmp_path: Path) -> None:
    with pytest.raises(Invalid, match="no such directory"):
        source_of(str(tmp_path / "missing"))
    with pytest.raises(Invalid, match="neither a directory nor an installed package"):
        source_of("no_such_package_here")
    with pytest.raises(Invalid, match="neither a directory nor an installed package"):
        source_of("json.decoder")
    (tmp_path / "mod.py").write_text("x = 1\n")
    with pytest.raises(Invalid, match="no test files"):
        source_of(str(tmp_path))
    found = source_of("mpmath")
    assert "mpmath/__init__.py" in found.files and "mpmath/tests/test_basic_ops.py" in found.tests


def test_a_hostile_source_is_read_without_hanging_following_links_or_crashing(tmp_path: Path) -> None:
    """What an attack on the maker found: a FIFO or a link to a device named like a module (hung,
    or read without end), expressions nested past the parser's depth (a traceback), an empty or
    odd --from, more files than a task carries (all read into memory first), ids from names that
    are not ASCII, and a mutation inside an f-string's `=` (its printed text changed too)."""
    repo = tmp_path / "répo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "__init__.py").write_text(CODE)
    (repo / "test_pkg.py").write_text("from pkg import total\n\ndef test_total():\n    assert total([1], 0) == 1\n")
    os.mkfifo(repo / "pkg" / "fifo.py")
    (repo / "pkg" / "zero.py").symlink_to("/dev/zero")
    (repo / "pkg" / "secret.py").symlink_to("/etc/passwd")
    (repo / "pkg" / "deep.py").write_text("def f(x):\n    return " + "+".join(["x"] * 20_000) + "\n")
    (repo / "deep_test.py").write_text("def test_deep():\n    assert " + "+".join(["1"] * 20_000) + "\n")
    found = source_of(str(repo))
    assert sorted(found.files) == ["deep_test.py", "pkg/__init__.py", "pkg/deep.py", "test_pkg.py"]
    assert sites(found.files["pkg/deep.py"]) == [] and "total" in callers(found)
    assert _id_part(found.name, 60) == "r_po" and _id_part("Basket.é", 120) == "Basket._"
    for odd in ("", "  ", "__main__", "-"):
        with pytest.raises(Invalid):
            source_of(odd)
    many = tmp_path / "many"
    many.mkdir()
    for number in range(MAX_FILES + 5):
        (many / f"m{number}.py").write_text("x = 1\n")
    with pytest.raises(Invalid, match="more Python files than a task may carry"):
        source_of(str(many))
    assert [s.kind for s in sites('def f(a):\n    return f"{a+1=}"\n')] == []
