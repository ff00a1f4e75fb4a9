"""Evaluation sets for the gate: prompts with expected answers, scored by exact, contains or
regex match on the model's greedy answer. A scenario set shows the adapter does the job it was
trained for; a regression set of general prompts guards against forgetting. A job that brings no
regression set is checked against the one the appliance ships (regression.jsonl, beside this
module), unless `finetune.regression_set` is none.

A set is JSONL, one item a line: {"prompt": "..."} or {"messages": [... ending with a user
turn]}, "expect": "...", and optionally "match": "exact" | "contains" (default) | "regex".
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from appliance.errors import Invalid

MATCHES = ("exact", "contains", "regex")
KINDS = ("scenarios", "regression")
SHIPPED_REGRESSION = Path(__file__).with_name("regression.jsonl")


class EvalSetError(Invalid):
    """An evaluation set file is malformed; the message names the file and line."""


def parse(path: Path) -> list[dict[str, Any]]:
    """Every item of a set, checked; the first bad line is an error naming it."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise EvalSetError(f"{path}: cannot read: {exc}") from exc
    items = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise EvalSetError(f"{where}: not JSON: {exc}") from exc
        items.append(_checked(item, where))
    if not items:
        raise EvalSetError(f"{path}: no items")
    return items


def _checked(item: object, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise EvalSetError(f"{where}: an item is a JSON object")
    if isinstance(item.get("prompt"), str) and item["prompt"].strip():
        messages = [{"role": "user", "content": item["prompt"]}]
    elif isinstance(item.get("messages"), list) and item["messages"]:
        messages = item["messages"]
        if not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
            raise EvalSetError(f"{where}: messages: each needs a role and a string content")
        if messages[-1].get("role") != "user":
            raise EvalSetError(f"{where}: messages: the last turn must be the user's")
    else:
        raise EvalSetError(f"{where}: needs a non-empty 'prompt' or 'messages'")
    expect, match = item.get("expect"), item.get("match", "contains")
    if not isinstance(expect, str) or not expect:
        raise EvalSetError(f"{where}: 'expect' must be a non-empty string")
    if match not in MATCHES:
        raise EvalSetError(f"{where}: 'match' must be one of {', '.join(MATCHES)}, not {match!r}")
    if match == "regex":
        try:
            re.compile(expect)
        except re.error as exc:
            raise EvalSetError(f"{where}: 'expect' is not a valid regular expression: {exc}") from exc
    return {"messages": messages, "expect": expect, "match": match}


def matches(answer: str, item: dict[str, Any]) -> bool:
    expect: str = item["expect"]
    if item["match"] == "exact":
        return answer.strip() == expect.strip()
    if item["match"] == "regex":
        return re.search(expect, answer) is not None
    return expect.lower() in answer.lower()


def score(items: list[dict[str, Any]], answers: list[str]) -> float:
    """The share of items whose answer (the same position in `answers`) matches."""
    if len(answers) != len(items):
        raise ValueError(f"{len(answers)} answers for {len(items)} items")
    return sum(matches(answer, item) for answer, item in zip(answers, items, strict=True)) / len(items)


def with_shipped_regression(sets: dict[str, list[dict[str, Any]]], regression_set: str, base: Path
                            ) -> tuple[dict[str, list[dict[str, Any]]], bool]:
    """The job's sets, with the shipped regression set where it brings none (and settings ask for
    it, and the base model has a chat template to put its questions in); whether it was added."""
    if "regression" in sets or regression_set == "none" or not has_chat_template(base):
        return sets, False
    return {**sets, "regression": parse(SHIPPED_REGRESSION)}, True


def has_chat_template(model: Path) -> bool:
    """Whether a checkpoint's tokenizer knows how to put a conversation (transformers keeps the
    template in tokenizer_config.json or a file of its own)."""
    if (model / "chat_template.jinja").is_file() or (model / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((model / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False
