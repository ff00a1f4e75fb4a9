"""What an engine answered, gathered from its JSON or its SSE events for the audit record: the
generated text, the tool calls (name and arguments, in order) and anything that could not be
parsed, kept whole so the completion hash loses nothing."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


def decode_json(raw: bytes) -> object:
    """Parse JSON from the engine whatever bytes it holds: invalid UTF-8 is kept (as surrogate
    escapes) rather than refused. Raises ValueError if it is not JSON."""
    return json.loads(raw.decode("utf-8", "surrogateescape"))


@dataclass
class _ToolCall:
    name: str = ""
    arguments: list[str] = field(default_factory=list)


@dataclass
class Answer:
    """The parts of one answer, streamed or whole."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[tuple[int, int], _ToolCall] = field(default_factory=dict)  # (choice, call) -> call
    unparsed: list[str] = field(default_factory=list)
    failed: bool = False  # the engine reported an error in it (a stream's error event)
    id: str | None = None  # the answer's id (its first event's), as its client got it

    def note_id(self, answer: object) -> None:
        """Keep the id of the answer or stream event `answer`, if none is kept yet."""
        if self.id is None and isinstance(answer, dict) and isinstance(answer.get("id"), str):
            self.id = answer["id"][:200]

    def add_choices(self, choices: object) -> str:
        """Take the text and tool calls of OpenAI `choices` (message, delta or completion text);
        return the text they add."""
        added = []
        for position, choice in enumerate(choices if isinstance(choices, list) else []):
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", position)
            for key in ("message", "delta"):
                part = choice.get(key)
                if not isinstance(part, dict):
                    continue
                if isinstance(part.get("content"), str):
                    added.append(part["content"])
                for name in ("reasoning", "reasoning_content"):  # vLLM's name, and its older one
                    if isinstance(part.get(name), str):
                        self.reasoning.append(part[name])
                self._add_tool_calls(index, part.get("tool_calls"))
            if isinstance(choice.get("text"), str):
                added.append(choice["text"])
        text = "".join(added)
        if text:
            self.text.append(text)
        return text

    def _add_tool_calls(self, choice: object, calls: object) -> None:
        for position, call in enumerate(calls if isinstance(calls, list) else []):
            if not isinstance(call, dict):
                continue
            key = (choice if isinstance(choice, int) else 0, call.get("index", position))
            entry = self.tool_calls.setdefault(key, _ToolCall())
            function = call.get("function")
            if not isinstance(function, dict):
                continue
            if isinstance(function.get("name"), str):
                entry.name += function["name"]
            if isinstance(function.get("arguments"), str):
                entry.arguments.append(function["arguments"])

    def add_unparsed(self, raw: bytes) -> None:
        """Keep bytes the engine sent that are not the JSON expected (lossless)."""
        self.unparsed.append(raw.decode("utf-8", "surrogateescape"))

    @property
    def tools_called(self) -> list[str]:
        """Names of the tools called, in order."""
        return [call.name for call in self.tool_calls.values()]

    @property
    def tool_arguments(self) -> list[str]:
        """The arguments of the tools called, as sent, in the same order."""
        return ["".join(call.arguments) for call in self.tool_calls.values()]

    def canonical(self) -> str | None:
        """The text the completion hash covers: canonical JSON of the text, the tool calls (name
        and arguments) and any unparsed bytes; None if the engine answered nothing."""
        if not (self.text or self.reasoning or self.tool_calls or self.unparsed):
            return None
        whole: dict[str, object] = {"text": "".join(self.text)}
        if self.reasoning:
            whole["reasoning"] = "".join(self.reasoning)
        if self.tool_calls:
            whole["tool_calls"] = [{"name": call.name, "arguments": "".join(call.arguments)}
                                   for call in self.tool_calls.values()]
        if self.unparsed:
            whole["unparsed"] = self.unparsed
        return json.dumps(whole, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
