"""Chat rows that offer tools: an agent's episode, or a tool-calling example, as OpenAI's chat
format has it. The row's `tools` are function schemas; an assistant turn may carry `tool_calls`
(each naming one of them, its arguments JSON text valid against its schema, checked exactly as the
gateway checks a model's calls); a `tool` turn is a call's result and follows the turn that made
the call. Every assistant turn of such a row is trained (its text and its calls); the system,
user and tool turns are context only (finetune.chat_tokens).

Stored normalised: each call as {"id", "type": "function", "function": {"name", "arguments"}},
arguments as text, each tool turn with the id of the call it answers."""

from __future__ import annotations

import json
import re
from typing import Any

from jsonschema.protocols import Validator

from appliance.tool_schemas import SchemaRefused, argument_problem, checker

MAX_TOOLS = 64
MAX_CALL_ID = 200
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")  # a function's name, as OpenAI's API allows


def tool_chat(messages: Any, tools: Any) -> dict[str, Any]:
    """The row {"messages", "tools"}, normalised; ValueError says what is wrong and where."""
    offered, checkers = _tools(tools)
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    out: list[dict[str, Any]] = []
    open_calls: list[str] = []  # ids of the last assistant turn's calls not yet answered
    for turn, message in enumerate(messages, start=1):
        where = f"messages: message {turn}"
        if not isinstance(message, dict):
            raise ValueError(f"{where}: must be an object with role and content")
        role = message.get("role")
        if role == "tool":
            out.append(_result(message, where, open_calls))
            continue
        open_calls = []
        if role != "assistant" and "tool_calls" in message:
            raise ValueError(f"{where}: only an assistant turn makes tool calls")
        if role == "assistant" and message.get("tool_calls") is not None:
            calls = _calls(message["tool_calls"], checkers, where, len(out))
            content = message.get("content")
            if content is not None and not isinstance(content, str):
                raise ValueError(f"{where}: content must be text or null")
            out.append({"role": "assistant", "content": content or "", "tool_calls": calls})
            open_calls = [call["id"] for call in calls]
            continue
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"{where}: role {role!r} is not one of system, user, assistant, tool")
        if role == "system" and turn != 1:
            raise ValueError(f"{where}: a system message may only come first")
        content = message.get("content")
        if not isinstance(content, str) or not content.strip():
            raise ValueError(f"{where}: empty {role} turn")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise ValueError("no assistant turn: nothing to learn from")
    if out[0]["role"] not in ("system", "user"):
        raise ValueError("messages: message 1: a chat starts with a system or user turn")
    return {"messages": out, "tools": offered}


def _tools(tools: Any) -> tuple[list[dict[str, Any]], dict[str, Validator | None]]:
    """The functions offered, normalised, and a validator of each one's arguments."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("'tools' must be a non-empty list of functions")
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"'tools' offers {len(tools)} functions, over {MAX_TOOLS}")
    found: dict[str, Validator | None] = {}
    offered = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise ValueError(f"{where}: must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ValueError(f"{where}.function.name: must be 1-64 letters, digits, '_', '.' or '-', "
                             "starting with a letter or '_'")
        if name in found:
            raise ValueError(f"{where}.function.name: a second function named {name!r}")
        if not isinstance(function.get("description", ""), str):
            raise ValueError(f"{where}.function.description: must be text")
        parameters = function.get("parameters")
        try:
            found[name] = None if parameters is None else checker(parameters, f"{where}.function.parameters")
        except SchemaRefused as refused:
            raise ValueError(refused.message) from None
        kept = {key: function[key] for key in ("name", "description", "parameters") if key in function}
        offered.append({"type": "function", "function": kept})
    return offered, found


def _calls(calls: Any, checkers: dict[str, Validator | None], where: str, position: int) -> list[dict[str, Any]]:
    if not isinstance(calls, list) or not calls:
        raise ValueError(f"{where}: tool_calls must be a non-empty list")
    out: list[dict[str, Any]] = []
    for n, call in enumerate(calls):
        at = f"{where}: tool call {n + 1}"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise ValueError(f"{at}: must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}")
        name, arguments = function.get("name"), function.get("arguments")
        if isinstance(arguments, dict):  # an object where OpenAI's format has its JSON text
            arguments = json.dumps(arguments, ensure_ascii=False)
        if not isinstance(name, str) or name not in checkers:
            raise ValueError(f"{at}: names {str(name)[:80]!r}, which is not among the row's tools")
        if (why := argument_problem(checkers[name], name, arguments)) is not None:
            raise ValueError(f"{at} ({name}): {why}")
        call_id = call.get("id", f"call_{position}_{n}")
        if not isinstance(call_id, str) or not call_id or len(call_id) > MAX_CALL_ID:
            raise ValueError(f"{at}: id must be text of 1-{MAX_CALL_ID} characters")
        if any(made["id"] == call_id for made in out):
            raise ValueError(f"{at}: id {call_id[:80]!r} is another call's of the same turn")
        out.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    return out


def _result(message: dict[str, Any], where: str, open_calls: list[str]) -> dict[str, Any]:
    """A tool turn: the result of the oldest call of the turn before that no result answered yet."""
    if not open_calls:
        raise ValueError(f"{where}: a tool result with no call before it to answer")
    content = message.get("content")
    if not isinstance(content, str):
        raise ValueError(f"{where}: a tool result's content must be text")
    call_id = message.get("tool_call_id", open_calls[0])
    if call_id not in open_calls:
        raise ValueError(f"{where}: tool_call_id {str(call_id)[:80]!r} names no unanswered call of the turn before")
    open_calls.remove(call_id)
    return {"role": "tool", "tool_call_id": call_id, "content": content}
