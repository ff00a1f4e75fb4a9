"""Tool calls checked before they reach the client: each call a model returns must name one of the
request's functions (the one `tool_choice` names, when it names one; none when it is "none") and
carry arguments that are a JSON object valid against that function's `parameters` schema; a
`tool_choice` that demands a call must get one.

A call that is not never goes out as a call. A whole answer is refused (502 `invalid_tool_call`,
naming the call, where its arguments fail and the schema's rule, never the value). A stream holds
each choice's calls back until the choice finishes, then sends them whole in the event that
finishes it, or ends in an error event in their place. So a streamed answer and a whole one to the
same request carry the same calls.

The schemas are the client's, so they are bounded when the request arrives (400 naming the tool):
a `$ref` resolves only inside the schema and never in a cycle (nothing is fetched, no schema is
recursive), the schema expanded through its references stays under MAX_SCHEMA_NODES, every
`pattern` compiles, and `patternProperties` and dynamic references are refused. The model's
arguments are bounded too (MAX_ARGUMENT_BYTES, strict JSON: no NaN, no infinite number, no
duplicate key), `pattern`s run with the `regex` module under one time budget per call, and
`uniqueItems` is checked by hashing: a hostile schema or answer cannot hold the gateway.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import regex
from jsonschema import Draft202012Validator, ValidationError, validators
from jsonschema.protocols import Validator
from referencing import Registry

from serve.errors import GatewayError

CHECK_BUDGET_S = 0.5  # all the `pattern`s of one call's arguments
MAX_SCHEMA_NODES = 20_000  # subschemas of one function's parameters, expanded through its references
MAX_ARGUMENT_BYTES = 1 << 20
REFUSED_KEYWORDS = ("patternProperties", "$dynamicRef", "$recursiveRef")
# Keywords whose value is a schema, a list of schemas, or a mapping of names to schemas.
ONE_SCHEMA = ("additionalProperties", "additionalItems", "items", "contains", "propertyNames", "not", "if", "then",
              "else", "unevaluatedItems", "unevaluatedProperties", "contentSchema")
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")

_deadline: ContextVar[float] = ContextVar("tool_check_deadline", default=math.inf)


class OverBudget(Exception):
    """The schema's patterns used up the call's time budget: the check stops there."""


class InvalidToolCall(GatewayError):
    """A call refused; `choices`: the streamed choices' calls as gathered (what the model tried)."""

    def __init__(self, message: str, choices: list[dict[str, Any]] | None = None) -> None:
        super().__init__(502, message, type="server_error", code="invalid_tool_call")
        self.choices = choices or []


def _timed_pattern(validator: Validator, pattern: object, instance: object,
                   schema: object) -> Iterator[ValidationError]:
    """jsonschema's `pattern` keyword with the `regex` module, within the call's time budget."""
    if not isinstance(instance, str) or not isinstance(pattern, str):
        return
    left = _deadline.get() - time.monotonic()
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


def _validator(schema: object, where: str) -> Validator:
    """A validator of `schema` (its own dialect, else 2020-12), or a 400 naming `where`."""
    def refused(why: str) -> GatewayError:
        return GatewayError(400, f"{where}: {why}", param=where)

    if not isinstance(schema, dict):
        raise refused("a schema must be a JSON object")
    if not isinstance(schema.get("$schema", ""), str):
        raise refused("$schema must be a string")
    try:
        kind = validators.validator_for(schema, default=Draft202012Validator)
        kind.check_schema(schema)
    except Exception as exc:  # SchemaError, and whatever an odd dialect makes jsonschema raise
        raise refused(f"not a JSON schema ({getattr(exc, 'message', type(exc).__name__)})"[:300]) from exc
    _bounded(schema, schema, refused)
    checked = validators.extend(  # type: ignore[no-untyped-call]
        kind, {"pattern": _timed_pattern, "uniqueItems": _unique_items})
    return checked(schema, registry=Registry())  # type: ignore[no-any-return]  # nothing is ever retrieved


def _bounded(root: dict[str, Any], node: object, refused: Callable[[str], GatewayError]) -> None:
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


def _pointer(root: dict[str, Any], ref: str, refused: Callable[[str], GatewayError]) -> object:
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


def _said(error: ValidationError) -> str:
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


@dataclass
class _Held:
    """A streamed call gathered from its deltas."""

    id: str | None = None
    name: str = ""
    arguments: list[str] = field(default_factory=list)

    def whole(self, index: int) -> dict[str, Any]:
        function = {"name": self.name, "arguments": "".join(self.arguments)}
        return {"index": index, **({"id": self.id} if self.id else {}), "type": "function", "function": function}


class ToolCheck:
    """The request's functions and `tool_choice`; checks the calls of one answer, whole or streamed."""

    def __init__(self, functions: dict[str, Validator | None], choice: str | None, named: str | None,
                 count: Callable[[str], None]) -> None:
        self.functions = functions
        self.choice = choice  # "none", "required", "auto" or None (a function named instead)
        self.named = named  # the one function tool_choice names
        self.count = count  # told each call's outcome: "passed" or "refused"
        self.held: dict[int, dict[int, _Held]] = {}  # choice -> call index -> call
        self.finished: set[int] = set()  # choices whose calls went out

    @classmethod
    def of(cls, tools: list[dict[str, Any]] | None, tool_choice: object,
           count: Callable[[str], None] = lambda outcome: None) -> ToolCheck | None:
        """The check for a chat request's `tools` and `tool_choice` (already shaped by its schema);
        None when it offers no tools. A 400 for a schema that cannot be checked, or a choice naming
        no tool."""
        if not tools:
            return None
        functions: dict[str, Validator | None] = {}
        for i, tool in enumerate(tools):
            function = tool["function"]
            name = function["name"]
            if name in functions:
                raise GatewayError(400, f"tools[{i}]: a second function named {name!r}",
                                   param=f"tools[{i}].function.name")
            parameters = function.get("parameters")
            functions[name] = None if parameters is None else _validator(parameters, f"tools[{i}].function.parameters")
        named = None
        if isinstance(tool_choice, dict):
            chosen = tool_choice.get("function")
            named = chosen.get("name") if isinstance(chosen, dict) else None
            if named not in functions:
                raise GatewayError(400, f"tool_choice names {str(named)[:80]!r}, which is not among the tools",
                                   param="tool_choice")
        return cls(functions, tool_choice if isinstance(tool_choice, str) else None, named, count)

    def problem(self, name: object, arguments: object) -> str | None:
        """What is wrong with one call, or None."""
        if self.choice == "none":
            return "tool_choice was \"none\""
        if not isinstance(name, str) or name not in self.functions:
            return f"it names {str(name)[:80]!r}, which is not among the request's tools"
        if self.named is not None and name != self.named:
            return f"tool_choice names {self.named!r}"
        parsed, why = parse_arguments(arguments)
        if parsed is None:
            return why
        checker = self.functions[name]
        if checker is None:
            return None
        token = _deadline.set(time.monotonic() + CHECK_BUDGET_S)
        try:
            error = next(iter(checker.iter_errors(parsed)), None)
        except OverBudget:
            return f"the schema's patterns took over {CHECK_BUDGET_S} s on its arguments"
        except Exception as exc:  # RecursionError on deep arguments, and anything else: fail closed
            return f"its arguments could not be checked against the schema of {name} ({type(exc).__name__})"
        finally:
            _deadline.reset(token)
        return None if error is None else f"its arguments do not match the schema of {name}: {_said(error)}"

    def _check(self, choice: object, position: int, name: object, arguments: object) -> None:
        if (why := self.problem(name, arguments)) is not None:
            self.count("refused")
            raise InvalidToolCall(f"the model's tool call {position} of choice {choice} was refused: {why}")
        self.count("passed")

    def _demanded(self, choice: object, calls: int) -> None:
        """A choice that finished without a call where tool_choice demanded one."""
        if calls == 0 and (self.choice == "required" or self.named is not None):
            self.count("refused")
            raise InvalidToolCall(f"choice {choice} has no tool call, and tool_choice demanded one")

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        """A whole answer, its calls checked (InvalidToolCall for the first that fails)."""
        for position, choice in enumerate(body.get("choices") or []):
            message = choice.get("message") if isinstance(choice, dict) else None
            if not isinstance(message, dict):
                continue
            index = choice.get("index", position)
            if "function_call" in message and message["function_call"] is not None:
                raise InvalidToolCall(f"choice {index} holds a legacy function_call, which is not checked")
            calls = message.get("tool_calls")
            if calls is not None and not isinstance(calls, list):
                raise InvalidToolCall(f"choice {index}: its tool_calls are not a list")
            for n, call in enumerate(calls or []):
                function = call.get("function") if isinstance(call, dict) else None
                function = function if isinstance(function, dict) else {}
                self._check(index, n, function.get("name"), function.get("arguments"))
            self._demanded(index, len(calls or []))
        return body

    def event(self, event: dict[str, Any]) -> dict[str, Any]:
        """One streamed event with its calls' deltas taken out and held; a choice that finishes
        gets its calls back whole, checked (InvalidToolCall for one that fails)."""
        for position, choice in enumerate(event.get("choices") or []):
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", position)
            if not isinstance(index, int) or isinstance(index, bool):
                raise self._refusal(f"a choice index {str(index)[:40]!r} that is not a number")
            delta = choice.get("delta")
            if isinstance(delta, dict) and delta.get("function_call") is not None:
                raise self._refusal(f"choice {index} holds a legacy function_call, which is not checked")
            if isinstance(delta, dict) and "tool_calls" in delta:
                if index in self.finished:
                    raise self._refusal(f"choice {index} sent tool calls after it finished")
                self._hold(index, delta.pop("tool_calls"))
            if choice.get("finish_reason") is not None:
                if not isinstance(delta, dict):
                    delta = choice["delta"] = {}
                released = self._release(index)
                if released:
                    delta["tool_calls"] = released
        return event

    def finish(self) -> list[dict[str, Any]]:
        """Events carrying the calls of choices the stream never finished, checked."""
        return [{"choices": [{"index": index, "delta": {"tool_calls": self._release(index)}}]}
                for index in sorted(self.held)]

    def gathered(self) -> list[dict[str, Any]]:
        """The calls still held (a stream cut short, or refused), as choices: what the model tried."""
        return [{"index": index, "delta": {"tool_calls": [call.whole(n) for n, call in sorted(calls.items())]}}
                for index, calls in sorted(self.held.items())]

    def _refusal(self, why: str) -> InvalidToolCall:
        self.count("refused")
        return InvalidToolCall(f"the model's tool calls were refused: {why}", self.gathered())

    def _hold(self, index: int, calls: object) -> None:
        if not isinstance(calls, list):
            raise self._refusal(f"choice {index}: its tool_calls are not a list")
        held = self.held.setdefault(index, {})
        for position, call in enumerate(calls):
            if not isinstance(call, dict):
                raise self._refusal(f"choice {index}: a tool call that is not an object")
            number = call.get("index", position)
            if not isinstance(number, int) or isinstance(number, bool):
                raise self._refusal(f"choice {index}: a call index {str(number)[:40]!r} that is not a number")
            entry = held.setdefault(number, _Held())
            entry.id = entry.id or (call["id"] if isinstance(call.get("id"), str) else None)
            function = call.get("function")
            if isinstance(function, dict):
                if isinstance(function.get("name"), str):
                    entry.name += function["name"]
                if isinstance(function.get("arguments"), str):
                    entry.arguments.append(function["arguments"])

    def _release(self, index: int) -> list[dict[str, Any]]:
        """A finished choice's calls, whole and checked; the choice takes no more."""
        calls = self.held.get(index, {})
        whole = [call.whole(n) for n, call in sorted(calls.items())]
        try:
            for n, call in enumerate(whole):
                self._check(index, n, call["function"]["name"], call["function"]["arguments"])
            self._demanded(index, len(whole))
        except InvalidToolCall as refused:
            raise InvalidToolCall(refused.message, self.gathered()) from None
        self.held.pop(index, None)
        self.finished.add(index)
        return whole
