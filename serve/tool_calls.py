"""Tool calls checked before they reach the client: each call a model returns must name one of the
request's functions (the one `tool_choice` names, when it names one; none when it is "none") and
carry arguments that are a JSON object valid against that function's `parameters` schema.

A call that is not never goes out as a call. A whole answer is refused (502 `invalid_tool_call`,
naming the call and what is wrong with it). A stream holds each choice's calls back until the
choice finishes, then sends them whole in the event that finishes it, or ends in an error event
in their place. So a streamed answer and a whole one to the same request carry the same calls.

The schemas are the client's: they are checked when the request arrives (400 naming the tool),
resolve `$ref` only inside themselves (nothing is fetched), may not use `patternProperties`, and
their `pattern`s run under a time limit (the `regex` module's): a hostile schema cannot hold the
gateway.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import regex
from jsonschema import Draft202012Validator, ValidationError, validators
from jsonschema.exceptions import SchemaError
from jsonschema.protocols import Validator

from serve.errors import GatewayError

PATTERN_TIMEOUT_S = 0.05  # one `pattern` against one string
MAX_REPORTED_CHARS = 300  # of a validation message in an error
REFUSED_KEYWORDS = ("patternProperties", "$dynamicRef")  # unbounded regexes on keys; references out of reach


def _timed_pattern(validator: Validator, pattern: object, instance: object,
                   schema: object) -> Iterator[ValidationError]:
    """jsonschema's `pattern` keyword with the `regex` module and a time limit."""
    if not isinstance(instance, str) or not isinstance(pattern, str):
        return
    try:
        found = regex.search(pattern, instance, timeout=PATTERN_TIMEOUT_S)
    except TimeoutError:
        yield ValidationError(f"the pattern {pattern!r} took over {PATTERN_TIMEOUT_S} s on the value")
        return
    except regex.error as exc:
        yield ValidationError(f"the pattern {pattern!r} is not a regular expression: {exc}")
        return
    if found is None:
        yield ValidationError(f"{instance[:80]!r} does not match {pattern!r}")


def _validator(schema: dict[str, Any], where: str) -> Validator:
    """A validator of `schema` (its own dialect, else 2020-12), or a 400 naming `where`."""
    try:
        kind = validators.validator_for(schema, default=Draft202012Validator)
        kind.check_schema(schema)
    except SchemaError as exc:
        raise GatewayError(400, f"{where} is not a JSON schema: {_said(exc)}", param=where) from exc
    for keyword, value in _keywords(schema):
        outside = keyword == "$ref" and not (isinstance(value, str) and value.startswith("#"))
        if keyword in REFUSED_KEYWORDS or outside:
            raise GatewayError(400, f"{where} uses {keyword} {str(value)[:80]!r}: tool schemas may refer only "
                               "inside themselves, and may not match property names by pattern", param=where)
    checked = validators.extend(kind, {"pattern": _timed_pattern})  # type: ignore[no-untyped-call]
    return checked(schema)  # type: ignore[no-any-return]


def _keywords(node: object) -> Iterator[tuple[str, object]]:
    """Every (key, value) of every object in a JSON document."""
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, dict):
            for key, value in current.items():
                yield key, value
                stack.append(value)
        elif isinstance(current, list):
            stack.extend(current)


def _said(exc: ValidationError | SchemaError) -> str:
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in exc.absolute_path)
    return f"at ${path}: {exc.message[:MAX_REPORTED_CHARS]}"


@dataclass
class _Held:
    """A streamed call gathered from its deltas."""

    id: str | None = None
    name: str = ""
    arguments: list[str] = field(default_factory=list)

    def whole(self, index: int) -> dict[str, Any]:
        function = {"name": self.name, "arguments": "".join(self.arguments)}
        return {"index": index, **({"id": self.id} if self.id else {}), "type": "function", "function": function}


class InvalidToolCall(GatewayError):
    """A call refused; `choices`: a streamed choice's calls as gathered (what the model tried)."""

    def __init__(self, message: str, choices: list[dict[str, Any]] | None = None) -> None:
        super().__init__(502, message, type="server_error", code="invalid_tool_call")
        self.choices = choices or []


class ToolCheck:
    """The request's functions and `tool_choice`; checks the calls of one answer, whole or streamed."""

    def __init__(self, functions: dict[str, Validator | None], named: str | None, none: bool,
                 count: Callable[[str], None]) -> None:
        self.functions = functions
        self.named = named  # the one function tool_choice names
        self.none = none  # tool_choice "none": no call at all
        self.count = count  # told each call's outcome: "passed" or "refused"
        self.held: dict[int, dict[int, _Held]] = {}  # choice -> call index -> call

    @classmethod
    def of(cls, tools: list[dict[str, Any]] | None, tool_choice: object,
           count: Callable[[str], None] = lambda outcome: None) -> ToolCheck | None:
        """The check for a chat request's `tools` and `tool_choice` (already shaped by its schema);
        None when it offers no tools. A 400 for a schema that is not one, or a choice naming no tool."""
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
        return cls(functions, named, tool_choice == "none", count)

    def problem(self, name: object, arguments: object) -> str | None:
        """What is wrong with one call, or None."""
        if self.none:
            return "tool_choice was \"none\""
        if not isinstance(name, str) or name not in self.functions:
            return f"it names {str(name)[:80]!r}, which is not among the request's tools"
        if self.named is not None and name != self.named:
            return f"tool_choice names {self.named!r}"
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else None
        except ValueError:
            return "its arguments are not JSON"
        if not isinstance(parsed, dict):
            return "its arguments are not a JSON object"
        checker = self.functions[name]
        if checker is not None:
            error = next(iter(checker.iter_errors(parsed)), None)
            if error is not None:
                return f"its arguments do not match the schema of {name}: {_said(error)}"
        return None

    def _check(self, choice: object, position: int, name: object, arguments: object) -> None:
        if (why := self.problem(name, arguments)) is not None:
            self.count("refused")
            raise InvalidToolCall(f"the model's tool call {position} of choice {choice} was refused: {why}")
        self.count("passed")

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        """A whole answer, its calls checked (InvalidToolCall for the first that fails)."""
        for position, choice in enumerate(body.get("choices") or []):
            message = choice.get("message") if isinstance(choice, dict) else None
            calls = message.get("tool_calls") if isinstance(message, dict) else None
            for n, call in enumerate(calls if isinstance(calls, list) else []):
                function = call.get("function") if isinstance(call, dict) else None
                function = function if isinstance(function, dict) else {}
                self._check(choice.get("index", position), n, function.get("name"), function.get("arguments"))
        return body

    def event(self, event: dict[str, Any]) -> dict[str, Any]:
        """One streamed event with its calls' deltas taken out and held; a choice that finishes
        gets its calls back whole, checked (InvalidToolCall for one that fails)."""
        for position, choice in enumerate(event.get("choices") or []):
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", position)
            delta = choice.get("delta")
            if isinstance(delta, dict) and "tool_calls" in delta:
                self._hold(index, delta.pop("tool_calls"))
            if choice.get("finish_reason") is not None and index in self.held:
                if not isinstance(delta, dict):
                    delta = choice["delta"] = {}
                delta["tool_calls"] = self._release(index)
        return event

    def finish(self) -> list[dict[str, Any]]:
        """Events carrying the calls of choices the stream never finished, checked."""
        return [{"choices": [{"index": index, "delta": {"tool_calls": self._release(index)}}]}
                for index in list(self.held)]

    def _hold(self, index: object, calls: object) -> None:
        held = self.held.setdefault(index if isinstance(index, int) else 0, {})
        for position, call in enumerate(calls if isinstance(calls, list) else []):
            if not isinstance(call, dict):
                continue
            entry = held.setdefault(call.get("index", position), _Held())
            entry.id = entry.id or (call["id"] if isinstance(call.get("id"), str) else None)
            function = call.get("function")
            if isinstance(function, dict):
                if isinstance(function.get("name"), str):
                    entry.name += function["name"]
                if isinstance(function.get("arguments"), str):
                    entry.arguments.append(function["arguments"])

    def _release(self, index: int) -> list[dict[str, Any]]:
        calls = self.held.pop(index)
        whole = [call.whole(n) for n, call in sorted(calls.items())]
        try:
            for n, call in enumerate(whole):
                self._check(index, n, call["function"]["name"], call["function"]["arguments"])
        except InvalidToolCall as refused:
            raise InvalidToolCall(refused.message, [{"index": index, "delta": {"tool_calls": whole}}]) from None
        return whole
