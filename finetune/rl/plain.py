"""Plain data across the execution sandbox's inner boundary (used by finetune/rl/harness.py and
finetune/rl/answer.py, in the sandbox, with no import from the appliance): what a test passes to the
answer's function and what the function returns, as JSON, and the equality the tests judge with.

Only values of exactly these types cross: None, bool, int, float, str, list, tuple, dict, set and
frozenset (of those); a subclass (an int whose == is always true), any other object, a cycle, or
more than MAX_DEPTH levels is refused. What the harness decodes is built by the harness itself, so
no comparison it makes runs the answer's code.

`strict_equal` is the tests' ==: types must match (True is not 1, 1.0 is not 1, a list is not a
tuple), floats are equal within a relative or absolute 1e-9, containers element by element.
"""

import json
import math
from typing import Any

MAX_DEPTH = 100
MAX_BYTES = 16 << 20  # one encoded value
MAX_KEYS = 10_000  # a set's or dict's: hashing many colliding keys costs the harness seconds
MAX_ITEMS = 1_000_000  # values in one decoded value
SCALARS = (type(None), bool, int, str)


class NotPlain(ValueError):
    """A value that is not plain data."""


def encode(value: Any) -> str:
    text = json.dumps(_tagged(value, 0), allow_nan=False, separators=(",", ":"))
    if len(text) > MAX_BYTES:
        raise NotPlain(f"a value of over {MAX_BYTES} bytes")
    return text


def decode(text: str | bytes) -> Any:
    if len(text) > MAX_BYTES:
        raise NotPlain(f"a value of over {MAX_BYTES} bytes")
    return _untagged(json.loads(text), 0, [MAX_ITEMS])


def _tagged(value: Any, depth: int) -> Any:
    """JSON for `value`: scalars as they are (a float as {"f": repr}, so NaN and infinities
    travel), containers as {"l"|"t"|"s"|"fs": [...]} and {"d": [[key, value], ...]}."""
    if depth > MAX_DEPTH:
        raise NotPlain(f"more than {MAX_DEPTH} levels")
    kind = type(value)
    if kind in SCALARS:
        return value
    if kind is float:
        return {"f": repr(value)}
    if kind in (list, tuple, set, frozenset):
        tags: dict[type, str] = {list: "l", tuple: "t", set: "s", frozenset: "fs"}
        return {tags[kind]: [_tagged(item, depth + 1) for item in value]}
    if kind is dict:
        return {"d": [[_tagged(key, depth + 1), _tagged(item, depth + 1)] for key, item in value.items()]}
    raise NotPlain(f"a {kind.__module__}.{kind.__qualname__}: only None, bool, int, float, str, list, tuple, "
                   "dict and set cross")


def _untagged(found: Any, depth: int, left: list[int]) -> Any:
    """The value `found` tags; `left`: how many more values this decoding may make."""
    if depth > MAX_DEPTH:
        raise NotPlain(f"more than {MAX_DEPTH} levels")
    left[0] -= 1
    if left[0] < 0:
        raise NotPlain(f"more than {MAX_ITEMS} values")
    if found is None or type(found) in (bool, int, str):
        return found
    if type(found) is not dict or len(found) != 1:
        raise NotPlain("not a tagged value")
    [(tag, inner)] = found.items()
    if tag == "f" and type(inner) is str:
        return float(inner)
    if type(inner) is not list:
        raise NotPlain(f"tag {tag!r} without a list")
    if tag in ("s", "fs", "d") and len(inner) > MAX_KEYS:
        raise NotPlain(f"a set or dict of over {MAX_KEYS} keys")
    items = [_untagged(item, depth + 1, left) for item in inner] if tag != "d" else []
    if tag == "l":
        return items
    if tag == "t":
        return tuple(items)
    if tag == "s":
        return set(items)
    if tag == "fs":
        return frozenset(items)
    if tag == "d":
        pairs = []
        for pair in inner:
            if type(pair) is not list or len(pair) != 2:
                raise NotPlain("a dict entry is a key and a value")
            pairs.append((_untagged(pair[0], depth + 1, left), _untagged(pair[1], depth + 1, left)))
        return dict(pairs)
    raise NotPlain(f"unknown tag {tag!r}")


def strict_equal(left: Any, right: Any) -> bool:
    """The tests' ==, on plain values (see the module's docstring)."""
    if type(left) is not type(right):
        return False
    if type(left) is float:
        return left == right or math.isclose(left, right, rel_tol=1e-9, abs_tol=1e-9)
    if type(left) in (list, tuple):
        return len(left) == len(right) and all(strict_equal(a, b) for a, b in zip(left, right, strict=True))
    if type(left) in (set, frozenset):
        return {_key(item) for item in left} == {_key(item) for item in right}
    if type(left) is dict:
        keyed = {_key(key): item for key, item in right.items()}
        return len(left) == len(right) and all(_key(key) in keyed and strict_equal(item, keyed[_key(key)])
                                               for key, item in left.items())
    return bool(left == right)


def strict_in(item: Any, container: Any) -> bool:
    """The tests' `in`: a substring in a string, else an element (a dict's key) strictly equal."""
    if type(container) is str:
        return type(item) is str and item in container
    if type(container) in (set, frozenset, dict):
        return _key(item) in {_key(element) for element in container}
    return any(strict_equal(item, element) for element in container)


def _key(value: Any) -> Any:
    """What a set element or dict key is, types included (True and 1, 1.0 and 1 differ)."""
    kind = type(value)
    if kind in (tuple, frozenset):
        return kind.__name__, kind(_key(item) for item in value)
    return kind.__name__, value
