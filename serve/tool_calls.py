"""Tool calls checked before they reach the client: each call a model returns must name one of the
request's functions (the one `tool_choice` names, when it names one; none when it is "none") and
carry arguments that are a JSON object valid against that function's `parameters` schema; a
`tool_choice` that demands a call must get one.

A call that is not never goes out as a call. A whole answer is refused (502 `invalid_tool_call`,
naming the call, where its arguments fail and the schema's rule, never the value). A stream holds
each choice's calls back until the choice finishes, then sends them whole in the event that
finishes it, or ends in an error event in their place. So a streamed answer and a whole one to the
same request carry the same calls.

The schemas are the client's, so they are bounded when the request arrives (400 naming the tool),
and each call's arguments are checked within bounds (appliance.tool_schemas): a hostile schema or
answer cannot hold the gateway.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jsonschema.protocols import Validator

from appliance.tool_schemas import SchemaRefused, argument_problem, checker
from serve.errors import GatewayError


class InvalidToolCall(GatewayError):
    """A call refused; `choices`: the streamed choices' calls as gathered (what the model tried)."""

    def __init__(self, message: str, choices: list[dict[str, Any]] | None = None) -> None:
        super().__init__(502, message, type="server_error", code="invalid_tool_call")
        self.choices = choices or []


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
            try:
                functions[name] = None if parameters is None else checker(parameters, f"tools[{i}].function.parameters")
            except SchemaRefused as refused:
                raise GatewayError(400, refused.message, param=refused.where) from None
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
        return argument_problem(self.functions[name], name, arguments)

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
