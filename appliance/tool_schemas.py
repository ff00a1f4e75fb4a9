"""Tool schemas and a call's arguments, checked within bounds: one home for the gateway's check of
every call a model returns (serve.tool_calls) and for the calls of training rows (finetune.datasets).

The schemas come from whoever sent them, so they are bounded before use: a `$ref` resolves only
inside the schema and never in a cycle (nothing is fetched, no schema is recursive), the schema
expanded through its references stays under MAX_SCHEMA_NODES, every `pattern` compiles, and
`patternProperties`, dynamic references, a `$id` below the root and dialects the walk does not
know are refused. Arguments are bounded too (MAX_ARGUMENT_BYTES, strict JSON: no NaN, no infinite
number, no duplicate key), every keyword of the check counts against one budget of CPU time per
call, `pattern`s run with the `regex` module within it, and `uniqueItems` is checked by hashing: a
hostile schema or call cannot hold the caller.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import regex
from jsonschema import Draft202012Validator, ValidationError, validators
from jsonschema.protocols import Validator
from referencing import Registry

from appliance.errors import Invalid

CHECK_BUDGET_S = 0.5  # CPU seconds checking one call's arguments (every keyword; a busy host's waits do not count)
MAX_SCHEMA_NODES = 20_000  # subschemas of one function's parameters, expanded through its references
MAX_ARGUMENT_BYTES = 1 << 20
REFUSED_KEYWORDS = ("patternProperties", "$dynamicRef", "$recursiveRef")
# The dialects whose keywords the walk knows (draft 3's `extends` and `disallow` it does not).
DIALECTS = ("https://json-schema.org/draft/2020-12/schema", "https://json-schema.org/draft/2019-09/schema",
            "http://json-schema.org/draft-07/schema")
# Keywords whose value is a schema, a list of schemas, or a mapping of names to schemas.
ONE_SCHEMA = ("additionalProperties", "additionalItems", "items", "contains", "propertyNames", "not", "if", "then",
              "else", "unevaluatedItems", "unevaluatedProperties", "contentSchema")
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")

_deadline: ContextVar[float] = ContextVar("tool_check_deadline", default=math.inf)


class OverBudget(Exception):
    """The check used up the call's budget of CPU time: it stops there."""


def _timed_pattern(validator: Validator, pattern: object, instance: object,
                   schema: object) -> Iterator[ValidationError]:
    """jsonschema's `pattern` keyword with the `regex` module, within the call's time budget."""
    if not isinstance(instance, str) or not isinstance(pattern, str):
        return
    left = _deadline.get() - time.thread_time()
    if left <= 0:
        raise OverBudget
    try:
        found = regex.search(pattern, instance, timeout=left)
    except TimeoutError:
        raise OverBudget from None
    if found is None:
        yield ValidationError(f"does not match the pattern {pattern[:80]!r}")


def _unique_items(validator: Validator, unique: object, instance: object, schema: object) -> Iterator[ValidationError]:
    """`uniqueItems` by hashing each item's canonical JSON (1 and 1.0 alike, as JSON Schema has it)."""
    if not unique or not isinstance(instance, list):
        return
    seen: set[str] = set()
    for item in instance:
        key = json.dumps(_integral(item), sort_keys=True)
        if key in seen:
            yield ValidationError("has non-unique items")
            return
        seen.add(key)


def _integral(value: object) -> object:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    return value


class SchemaRefused(Invalid):
    """A tool schema that cannot be checked: `where` it is (tools[0].function.parameters, say), and why."""

    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"{where}: {why}")
        self.where, self.why = where, why


def checker(schema: object, where: str) -> Validator:
    """A validator of `schema` (its own dialect, else 2020-12); SchemaRefused naming `where`."""
    def refused(why: str) -> SchemaRefused:
        return SchemaRefused(where, why)

    if not isinstance(schema, dict):
        raise refused("a schema must be a JSON object")
    if not isinstance(schema.get("$schema", ""), str):
        raise refused("$schema must be a string")
    if schema.get("$schema", DIALECTS[0]).rstrip("#") not in DIALECTS:
        raise refused(f"$schema {str(schema['$schema'])[:80]!r}: one of {', '.join(DIALECTS)}")
    try:
        kind = validators.validator_for(schema, default=Draft202012Validator)
        kind.check_schema(schema)
    except Exception as exc:  # SchemaError, and whatever an odd dialect makes jsonschema raise
        raise refused(f"not a JSON schema ({getattr(exc, 'message', type(exc).__name__)})"[:300]) from exc
    _bounded(schema, schema, refused)
    keywords = {name: _timed(check) for name, check in kind.VALIDATORS.items()}
    checked = validators.extend(  # type: ignore[no-untyped-call]
        kind, keywords | {"pattern": _timed_pattern, "uniqueItems": _timed(_unique_items)})
    return checked(schema, registry=Registry())  # type: ignore[no-any-return]  # nothing is ever retrieved


def _timed(keyword: Callable[..., Iterator[ValidationError] | None]) -> Callable[..., Iterator[ValidationError]]:
    """A keyword's check that first looks at the call's time budget: a schema whose checks multiply
    (branches of anyOf over references, an enum of thousands against as many items) stops there."""
    def check(validator: Validator, value: object, instance: object, schema: object) -> Iterator[ValidationError]:
        if time.thread_time() > _deadline.get():
            raise OverBudget
        yield from keyword(validator, value, instance, schema) or ()

    return check


def _bounded(root: dict[str, Any], node: object, refused: Callable[[str], SchemaRefused]) -> None:
    """Walks the schema through its references: refuses what cannot be checked within bounds."""
    count = 0
    stack: list[tuple[object, tuple[str, ...]]] = [(node, ())]  # a subschema, the references on its way
    while stack:
        current, refs = stack.pop()
        count += 1
        if count > MAX_SCHEMA_NODES:
            raise refused(f"the schema expands to over {MAX_SCHEMA_NODES} subschemas through its references")
        if not isinstance(current, dict):
            continue
        if current is not root and "$id" in current:  # its references would resolve against another base
            raise refused("an $id below the schema's root is not supported (its references would resolve elsewhere)")
        for keyword in REFUSED_KEYWORDS:
            if keyword in current:
                raise refused(f"{keyword} is not supported in tool schemas")
        if isinstance(pattern := current.get("pattern"), str):
            try:
                regex.compile(pattern)
            except Exception as exc:  # regex.error, OverflowError, RecursionError: all a bad pattern
                raise refused(f"the pattern {pattern[:80]!r} is not a usable regular expression") from exc
        if "$ref" in current:
            ref = current["$ref"]
            if not isinstance(ref, str) or not ref.startswith("#"):
                raise refused(f"$ref {str(ref)[:80]!r}: a tool schema may refer only inside itself")
            if ref in refs:
                raise refused(f"$ref {ref[:80]!r} refers to itself through {len(refs)} references: recursive "
                              "schemas are not supported")
            stack.append((_pointer(root, ref, refused), (*refs, ref)))
        stack.extend((sub, refs) for sub in _subschemas(current))


def _subschemas(schema: dict[str, Any]) -> Iterator[object]:
    for keyword in ONE_SCHEMA:
        if isinstance(schema.get(keyword), dict):
            yield schema[keyword]
    for keyword in SCHEMA_LISTS:
        if isinstance(schema.get(keyword), list):
            yield from schema[keyword]
    for keyword in SCHEMA_MAPS:
        if isinstance(schema.get(keyword), dict):
            yield from (v for v in schema[keyword].values() if isinstance(v, dict))


def _pointer(root: dict[str, Any], ref: str, refused: Callable[[str], SchemaRefused]) -> object:
    """The subschema a local `$ref` ("#", "#/$defs/x") names, or a 400."""
    node: object = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        key = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            raise refused(f"$ref {ref[:80]!r} names nothing in the schema")
    if ref != "#" and not ref.startswith("#/"):
        raise refused(f"$ref {ref[:80]!r}: only JSON pointers (#/...) are supported")
    return node


def said(error: ValidationError) -> str:
    """Where the arguments fail and the schema's rule: never the model's value (it may be what the
    compliance filter would redact)."""
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
    rule = json.dumps(error.validator_value, ensure_ascii=False, default=str)
    if error.validator in ("pattern", "uniqueItems"):  # their messages name no value
        return f"at ${path}: {error.message[:200]}"
    return f"at ${path}: fails {error.validator} {rule[:200]}"


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is not a finite number")
    return value


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    found = dict(pairs)
    if len(found) != len(pairs):
        raise ValueError("an object with a key twice")
    return found


def parse_arguments(arguments: object) -> tuple[dict[str, Any] | None, str | None]:
    """The arguments as a JSON object, or why they are not one (strict JSON, bounded)."""
    if not isinstance(arguments, str):
        return None, "its arguments are not a string of JSON"
    if len(arguments.encode("utf-8", "surrogatepass")) > MAX_ARGUMENT_BYTES:
        return None, f"its arguments are over {MAX_ARGUMENT_BYTES} bytes"
    try:
        parsed = json.loads(arguments, parse_constant=_no_constant, parse_float=_finite,
                            object_pairs_hook=_unique_keys)
    except RecursionError:
        return None, "its arguments are nested too deeply"
    except ValueError as exc:
        return None, f"its arguments are not JSON ({str(exc)[:120]})"
    if not isinstance(parsed, dict):
        return None, "its arguments are not a JSON object"
    return parsed, None




def argument_problem(check: Validator | None, name: str, arguments: object) -> str | None:
    """What is wrong with a call's arguments (JSON text) against its function's validator (None: the
    function has no schema), or None. Fails closed: a check that cannot finish is a problem."""
    parsed, why = parse_arguments(arguments)
    if parsed is None:
        return why
    if check is None:
        return None
    token = _deadline.set(time.thread_time() + CHECK_BUDGET_S)
    try:
        error = next(iter(check.iter_errors(parsed)), None)
    except OverBudget:
        return f"checking its arguments against the schema took over {CHECK_BUDGET_S} s"
    except Exception as exc:  # RecursionError on deep arguments, and anything else: fail closed
        return f"its arguments could not be checked against the schema of {name} ({type(exc).__name__})"
    finally:
        _deadline.reset(token)
    return None if error is None else f"its arguments do not match the schema of {name}: {said(error)}"
