"""Training datasets: every row parsed and validated (chat `messages`, `prompt`/`completion`, or
plain text), scanned for sensitive data, split train/eval by a hash of each row (the same rows
land in the same split whatever their order), and stored content-addressed in the artifact store.
Nothing is stored unless every row is good. The records of stored datasets, and reading them
back, are the core's (appliance.datasets)."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from appliance.artifacts import ArtifactStore
from appliance.datasets import PREFIX, content_digest, name_version
from appliance.errors import Invalid
from appliance.home import Home
from appliance.sensitive import Scanner, scanner_from
from appliance.settings import ComplianceSettings
from finetune.tool_rows import tool_chat

ROLES = ("system", "user", "assistant")
Problem = tuple[int, str]  # a line of the file, and what is wrong there
# How far a long check is: what it does, rows done, rows in all (the CLI draws a progress bar).
OnProgress = Callable[[str, int, int], None]
SHOWN_PROBLEMS = 20


class DatasetError(Invalid):
    """A dataset that cannot be imported (the caller's file); `problems` lists every bad row."""

    def __init__(self, message: str, problems: list[str] | None = None, **kwargs: Any) -> None:
        shown = problems[:SHOWN_PROBLEMS] if problems else []
        more = f"\n  ... and {len(problems) - len(shown)} more" if problems and len(problems) > len(shown) else ""
        super().__init__(message + "".join(f"\n  {p}" for p in shown) + more, **kwargs)
        self.problems = problems or []


@dataclass(frozen=True)
class Row:
    line: int
    example: dict[str, Any]  # {"messages": [...]} (and "tools": finetune.tool_rows), or {"text": ...}


@dataclass
class Imported:
    name: str
    digest: str
    rows: int
    train: int
    eval: int
    sensitive: dict[str, int] = field(default_factory=dict)
    action: str = "allow"


def parse(path: Path) -> list[Row]:
    """Rows of a JSONL (chat or prompt/completion) or plain-text file; DatasetError lists every
    bad line. Plain text: one example per paragraph (blank-line separated)."""
    rows, problems = read(path)
    if problems:
        raise DatasetError(f"{path}: {len(problems)} bad rows, nothing imported:", _lines(problems))
    if mixed := _mixed_kinds(rows):
        first, other = mixed
        raise DatasetError(f"{path}: line {first.line} holds {kind(first.example)} and line {other.line} "
                           f"{kind(other.example)}: a dataset holds SFT rows or preference rows, not both")
    return rows


def read(path: Path) -> tuple[list[Row], list[Problem]]:
    """Every row of the file that is good, and what is wrong with each line that is not (an
    unreadable or empty file raises DatasetError at once: there is nothing to check)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{path}: cannot read as UTF-8 text: {exc}") from exc
    if path.suffix == ".txt":
        return _paragraphs(path, text), []
    rows: list[Row] = []
    problems: list[Problem] = []
    # Lines end at newlines only: a JSON string may hold U+2028 and the like, which splitlines() splits at.
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
            if _surrogate(value):
                raise ValueError("a lone surrogate (an escape like \\ud800 that is no character): not valid Unicode")
            rows.append(Row(number, normalise(value)))
        except ValueError as exc:
            problems.append((number, str(exc)))
        except RecursionError:
            problems.append((number, "nested too deeply"))
    if not rows and not problems:
        raise DatasetError(f"{path}: no rows")
    return rows, problems


def _surrogate(value: Any) -> bool:
    """Whether any string in `value` (keys too) holds a lone surrogate."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if any("\ud800" <= c <= "\udfff" for c in item):
                return True
        elif isinstance(item, list):
            stack += item
        elif isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
    return False


def _mixed_kinds(rows: list[Row]) -> tuple[Row, Row] | None:
    """The first row and the first of another kind, if the rows mix SFT and preference rows."""
    if not rows:
        return None
    first = rows[0]
    other = next((row for row in rows if kind(row.example) != kind(first.example)), None)
    return None if other is None else (first, other)


def kind(example: dict[str, Any]) -> str:
    """'preference rows' (prompt, chosen, rejected: for DPO) or 'SFT rows' (chat or text)."""
    return "preference rows" if "chosen" in example else "SFT rows"


def _paragraphs(path: Path, text: str) -> list[Row]:
    rows: list[Row] = []
    lines: list[str] = []
    start = 1
    for number, line in enumerate([*text.splitlines(), ""], start=1):
        if line.strip():
            if not lines:
                start = number
            lines.append(line)
        elif lines:
            rows.append(Row(start, {"text": "\n".join(lines)}))
            lines = []
    if not rows:
        raise DatasetError(f"{path}: no text")
    return rows


def normalise(value: Any) -> dict[str, Any]:
    """The row as {"messages": [...]} or {"text": ...}; ValueError says what is wrong."""
    if not isinstance(value, dict):
        raise ValueError("a row must be a JSON object")
    if "tools" in value:
        if "messages" not in value:
            raise ValueError("'tools' are offered in chat rows ('messages') only")
        return tool_chat(value["messages"], value["tools"])
    if "messages" in value:
        return {"messages": _messages(value["messages"])}
    if "chosen" in value or "rejected" in value:
        return _preference(value)
    if "prompt" in value or "completion" in value:
        prompt, completion = value.get("prompt"), value.get("completion")
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError("'prompt' must be non-empty text")
        if not isinstance(completion, str) or not completion.strip():
            raise ValueError("'completion' must be non-empty text")
        return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]}
    if "text" in value:
        if not isinstance(value["text"], str) or not value["text"].strip():
            raise ValueError("'text' must be non-empty text")
        return {"text": value["text"]}
    raise ValueError("expected 'messages', 'prompt'/'completion', 'prompt'/'chosen'/'rejected' or 'text'")


def _preference(value: dict[str, Any]) -> dict[str, Any]:
    """A preference row (for DPO): the prompt (text or chat turns) and two answers to it (text, or
    one assistant turn each), the chosen one better than the rejected one."""
    prompt = value.get("prompt")
    if isinstance(prompt, str) and prompt.strip():
        prompt = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt:
        prompt = _turns(prompt, "prompt")
        if prompt[-1]["role"] != "user":
            raise ValueError("'prompt' must end with a user turn")
    else:
        raise ValueError("'prompt' must be non-empty text or a list of turns")
    answers = {}
    for side in ("chosen", "rejected"):
        answer = value.get(side)
        if isinstance(answer, list) and len(answer) == 1 and isinstance(answer[0], dict):
            answer = answer[0].get("content") if answer[0].get("role") == "assistant" else None
        if not isinstance(answer, str) or not answer.strip():
            raise ValueError(f"'{side}' must be non-empty text or one assistant turn")
        answers[side] = [{"role": "assistant", "content": answer}]
    if answers["chosen"] == answers["rejected"]:
        raise ValueError("'chosen' and 'rejected' are the same answer")
    return {"prompt": prompt, **answers}


def _messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    out = _turns(messages, "messages")
    if not any(m["role"] == "assistant" for m in out):
        raise ValueError("no assistant turn: nothing to learn from")
    return out


def _turns(messages: list[Any], field: str) -> list[dict[str, str]]:
    out = []
    for turn, message in enumerate(messages, start=1):
        if not isinstance(message, dict):
            raise ValueError(f"{field}: message {turn}: must be an object with role and content")
        role, content = message.get("role"), message.get("content")
        if role == "tool" or message.get("tool_calls") is not None:
            raise ValueError(f"{field}: message {turn}: a tool call or result in a row that offers no 'tools'")
        if role not in ROLES:
            raise ValueError(f"{field}: message {turn}: role {role!r} is not one of {', '.join(ROLES)}")
        if role == "system" and turn != 1:
            raise ValueError(f"{field}: message {turn}: a system message may only come first")
        if not isinstance(content, str) or not content.strip():
            raise ValueError(f"{field}: message {turn}: empty {role} turn")
        out.append({"role": role, "content": content})
    return out


def check_lengths(rows: list[Row], count_tokens: Callable[[dict[str, Any]], int], context: int) -> None:
    """Every row fits the model's context once its chat template is applied."""
    if problems := _too_long(rows, count_tokens, context):
        raise DatasetError(f"{len(problems)} rows are too long, nothing imported:", _lines(problems))


def _too_long(rows: list[Row], count_tokens: Callable[[dict[str, Any]], int], context: int,
              on_progress: OnProgress | None = None) -> list[Problem]:
    problems = []
    for done, row in enumerate(rows, start=1):
        if (tokens := count_tokens(row.example)) > context:
            problems.append((row.line, f"{tokens} tokens after the chat template, over the {context}-token context"))
        if on_progress:
            on_progress("measuring rows", done, len(rows))
    return problems


@dataclass(frozen=True)
class Checked:
    rows: list[Row]  # redacted where compliance.training_data says so
    sensitive: dict[str, int]  # findings by kind


def check(path: Path, count_tokens: Callable[[dict[str, Any]], int], context: int, settings: ComplianceSettings,
          on_progress: OnProgress | None = None) -> Checked:
    """Every check of a dataset file in one pass: each line a good row, one kind of row, each row
    within the context, sensitive data as `compliance.training_data` says. Every problem found is
    reported together, by line, in one DatasetError (nothing imported). Lines that are not rows
    cannot be measured or scanned: they are reported for what is wrong with them."""
    rows, problems = read(path)
    if mixed := _mixed_kinds(rows):
        first, other = mixed
        problems.append((other.line, f"{kind(other.example)} among the {kind(first.example)} of line {first.line}: "
                                     "a dataset holds SFT rows or preference rows, not both"))
    problems += _too_long(rows, count_tokens, context, on_progress)
    scanner = scanner_from(settings)
    found = _findings(rows, scanner, on_progress)
    counts = dict(Counter(kind for _, kind in found))
    if found and settings.training_data == "block":
        problems += found
    if found and settings.training_data == "redact":
        problems += _unredactable(rows, scanner)
    if problems:
        raise DatasetError(_refusal(path, problems, counts if settings.training_data == "block" else {}),
                           _lines(sorted(problems)))
    if found and settings.training_data == "redact":
        rows = [Row(row.line, _redacted(row.example, scanner)) for row in rows]
    return Checked(rows, counts)


def _refusal(path: Path, problems: list[Problem], blocked: dict[str, int]) -> str:
    lines = len({line for line, _ in problems})
    said = f"{path}: {len(problems)} problems on {lines} lines"
    if blocked:
        said += f", {_sensitive_summary(blocked)}"
    return said + "; nothing imported:"


def _lines(problems: list[Problem]) -> list[str]:
    return [f"line {line}: {what}" for line, what in problems]


def screen(rows: list[Row], settings: ComplianceSettings) -> tuple[list[Row], dict[str, int]]:
    """`scan` with the scanner the gateway screens with too and the action for training data, as
    the `compliance` settings say."""
    return scan(rows, scanner_from(settings), settings.training_data)


def scan(rows: list[Row], scanner: Scanner, action: str) -> tuple[list[Row], dict[str, int]]:
    """Counts of sensitive findings by kind; under 'block' any finding refuses the dataset (naming
    lines and kinds, never the text), under 'redact' they are replaced."""
    found = _findings(rows, scanner)
    counts = dict(Counter(kind for _, kind in found))
    if found and action == "block":
        raise DatasetError(f"{_sensitive_summary(counts)}; nothing imported:", _lines(found))
    if found and action == "redact":
        if fixed := _unredactable(rows, scanner):
            raise DatasetError("sensitive data that redaction cannot change; nothing imported:", _lines(fixed))
        rows = [Row(row.line, _redacted(row.example, scanner)) for row in rows]
    return rows, counts


def _findings(rows: list[Row], scanner: Scanner, on_progress: OnProgress | None = None) -> list[Problem]:
    """Each sensitive finding: its line and kind (never the text)."""
    found: list[Problem] = []
    for done, row in enumerate(rows, start=1):
        for text in _texts(row.example):
            found += [(row.line, finding.kind) for finding in scanner.findings(text)]
        if on_progress:
            on_progress("scanning for sensitive data", done, len(rows))
    return found


def _sensitive_summary(counts: dict[str, int]) -> str:
    return (f"sensitive data found ({', '.join(f'{k}: {n}' for k, n in sorted(counts.items()))}) "
            "(compliance.training_data = block; remove it, or set it to redact or allow)")


def _texts(example: dict[str, Any]) -> list[str]:
    """What a row says: its text, or each turn's content and each call's arguments, and what
    `_fixed` names."""
    if "text" in example:
        return [example["text"]]
    said = [text for field, turns in example.items() if field != "tools" for m in turns
            for text in [m["content"], *(c["function"]["arguments"] for c in m.get("tool_calls", []))]]
    return said + _fixed(example)


def _fixed(example: dict[str, Any]) -> list[str]:
    """What a row that offers tools says that redaction cannot change without changing what its
    calls mean: the tools (names, descriptions, schemas: shown to the model in every prompt), the
    calls' names and every id."""
    if "tools" not in example:
        return []
    found = _strings(example["tools"])
    for m in example["messages"]:
        found += [m["tool_call_id"]] if "tool_call_id" in m else []
        found += [text for c in m.get("tool_calls", []) for text in (c["id"], c["function"]["name"])]
    return found


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in [k, *_strings(v)]]
    return []


def _unredactable(rows: list[Row], scanner: Scanner) -> list[Problem]:
    return [(row.line, f"{finding.kind} in a tool offered, a call's name or an id, which redaction cannot change "
                       "without changing the calls: remove it")
            for row in rows for text in _fixed(row.example) for finding in scanner.findings(text)]


def _redacted(example: dict[str, Any], scanner: Scanner) -> dict[str, Any]:
    """The row with what the scanner finds redacted: in a call's arguments, inside their strings
    (they stay JSON)."""
    if "text" in example:
        return {"text": scanner.redact(example["text"])}

    def turn(m: dict[str, Any]) -> dict[str, Any]:
        calls = [{**c, "function": {**c["function"], "arguments": json.dumps(
            _redact_strings(json.loads(c["function"]["arguments"]), scanner), ensure_ascii=False)}}
            for c in m.get("tool_calls", [])]
        return {**m, "content": scanner.redact(m["content"]), **({"tool_calls": calls} if calls else {})}

    return {field: turns if field == "tools" else [turn(m) for m in turns] for field, turns in example.items()}


def _redact_strings(value: Any, scanner: Scanner) -> Any:
    if isinstance(value, str):
        return scanner.redact(value)
    if isinstance(value, list):
        return [_redact_strings(v, scanner) for v in value]
    if isinstance(value, dict):
        return {scanner.redact(k): _redact_strings(v, scanner) for k, v in value.items()}
    return value


def split(rows: list[Row], eval_fraction: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Train and eval rows, chosen by each row's hash: reproducible and order-independent."""
    keyed = sorted((hashlib.sha256(_line(row.example)).hexdigest(), row.example) for row in rows)
    cut = round(len(keyed) * eval_fraction)
    if eval_fraction > 0 and len(keyed) > 1:
        cut = max(cut, 1)
    return [e for _, e in keyed[cut:]], [e for _, e in keyed[:cut]]


def _line(example: dict[str, Any]) -> bytes:
    return json.dumps(example, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()


def store(name: str, source: Path, train: list[dict[str, Any]], evaluation: list[dict[str, Any]],
          sensitive: dict[str, int],
          action: str, artifacts: ArtifactStore, home: Home, *, replace: bool) -> Imported:
    """Put the dataset in the store under its content hash and name it in the local registry; a
    name already taken only with `replace` (its earlier versions stay in the store)."""
    done = put(name, source, train, evaluation, sensitive, action, artifacts)
    name_version(home, name, done.digest, replace=replace)
    return done


def put(name: str, source: Path, train: list[dict[str, Any]], evaluation: list[dict[str, Any]],
        sensitive: dict[str, int], action: str, artifacts: ArtifactStore) -> Imported:
    """Put a dataset's files in the store under its content hash (not named yet: appliance.datasets.register)."""
    train_bytes = b"".join(_line(e) + b"\n" for e in train)
    eval_bytes = b"".join(_line(e) + b"\n" for e in evaluation)
    digest = content_digest(train_bytes, eval_bytes)
    rows = len(train) + len(evaluation)
    meta = {"name": name, "sha256": digest, "source": source.name, "rows": rows,
            "kind": kind((train or evaluation)[0]) if rows else None,
            "train": len(train), "eval": len(evaluation), "sensitive": sensitive, "sensitive_action": action,
            "created": datetime.now(UTC).isoformat(timespec="seconds")}
    for key, data in (("train.jsonl", train_bytes), ("eval.jsonl", eval_bytes),
                      ("meta.json", json.dumps(meta, indent=1).encode())):
        artifacts.put(f"{PREFIX}{digest}/{key}", data, retain_days=0)
    return Imported(name=name, digest=digest, rows=rows, train=len(train), eval=len(evaluation),
                    sensitive=sensitive, action=action)
