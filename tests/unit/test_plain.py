"""Plain data across the execution sandbox's inner boundary (finetune/rl/plain.py): only values of
exactly the plain types cross, they come back as they went, and the tests' == is type-strict."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from finetune.rl import plain

scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.lists(inner, max_size=4).map(tuple)
                      | st.dictionaries(st.text(max_size=5) | st.integers(), inner, max_size=4)
                      | st.frozensets(st.integers() | st.text(max_size=5), max_size=4), max_leaves=20)


@given(values)
def test_plain_values_come_back_as_they_went(value: Any) -> None:
    back = plain.decode(plain.encode(value))
    assert plain.strict_equal(back, value) and type(back) is type(value)


class AlwaysEqual:
    def __eq__(self, other: object) -> bool:
        return True


class Sly(int):
    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = int.__hash__


@pytest.mark.parametrize("value", [AlwaysEqual(), Sly(3), [1, Sly(2)], {"k": AlwaysEqual()}, (x for x in []),
                                   type("S", (str,), {})("x"), b"bytes", print], ids=[
    "object", "int-subclass", "nested", "dict-value", "generator", "str-subclass", "bytes", "function"])
def test_anything_but_plain_data_is_refused(value: Any) -> None:
    with pytest.raises(plain.NotPlain):
        plain.encode(value)


def test_cycles_depth_and_size_are_bounded() -> None:
    looped: list[Any] = []
    looped.append(looped)
    with pytest.raises((plain.NotPlain, RecursionError, ValueError)):
        plain.encode(looped)
    deep: Any = 0
    for _ in range(plain.MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(plain.NotPlain):
        plain.encode(deep)
    with pytest.raises(plain.NotPlain):
        plain.decode('{"l": [' + ",".join(["1"] * 10) + "]" + " " * plain.MAX_BYTES + "}")
    for forged in ('{"x": 1}', '{"l": 1}', '{"d": [[1]]}', '[1, 2]', '1.5', '{"f": 1}'):
        with pytest.raises(plain.NotPlain):
            plain.decode(forged)


def test_the_tests_equality_is_type_strict_with_a_float_tolerance() -> None:
    assert not plain.strict_equal(True, 1) and not plain.strict_equal(1.0, 1) and not plain.strict_equal([1], (1,))
    assert plain.strict_equal(0.1 + 0.2, 0.3) and not plain.strict_equal(0.3001, 0.3)
    assert not plain.strict_equal(math.nan, math.nan)
    assert plain.strict_equal({"a": [1, (2.0, None)]}, {"a": [1, (2.0, None)]})
    assert not plain.strict_equal({"a": [1, (2.0, None)]}, {"a": [1, (2, None)]})
    assert plain.strict_equal({1, 2}, {2, 1}) and not plain.strict_equal({1}, frozenset({1}))


def test_sets_dict_keys_and_in_are_type_strict_too() -> None:
    assert not plain.strict_equal({True, 2.0}, {1, 2}) and plain.strict_equal({1, 2}, {2, 1})
    assert not plain.strict_equal({1.0: 1}, {1: 1}) and plain.strict_equal({(1, "a"): [1.0]}, {(1, "a"): [1.0]})
    assert not plain.strict_in(True, [1, 2]) and plain.strict_in(2, [1, 2]) and not plain.strict_in(1.0, {1: "x"})
    assert plain.strict_in("ell", "hello") and not plain.strict_in(["e"], "hello")


def test_a_reply_of_many_keys_or_values_is_refused_before_it_costs_the_harness() -> None:
    many = '{"s": [' + ",".join(str(n) for n in range(plain.MAX_KEYS + 1)) + "]}"
    with pytest.raises(plain.NotPlain, match="keys"):
        plain.decode(many)
    with pytest.raises(plain.NotPlain, match="values"):
        plain.decode('{"l": [' + ",".join(["[]"] * 0) + ",".join(['{"l": []}'] * (plain.MAX_ITEMS + 1)) + "]}")


def test_the_tests_take_from_the_answer_only_what_they_call_and_define_nowhere() -> None:
    import ast

    from finetune.rl.harness import answered_names

    tests = ast.parse("import math\nHELPER = 3\n\ndef poly(xs, x):\n    return x\n\n"
                      "def check(candidate):\n    assert abs(candidate(1) - poly([], 1)) < 1e-6\n"
                      "    assert helper_of_the_answer(2) == len(range(3))\n")
    assert answered_names(tests, "find_zero") == {"find_zero", "helper_of_the_answer"}
