"""Training datasets: every row parsed and validated (chat `messages`, `prompt`/`completion`, or
plain text), scanned for sensitive data, split train/eval by a hash of each row (the same rows
land in the same split whatever their order), and stored content-addressed in the artifact store.
Nothing is stored unless every row is good."""

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
from appliance.errors import ApplianceError, IntegrityError
from appliance.home import Home
from appliance.registry import JsonRegistry
from appliance.sensitive import Scanner, scanner_from
from appliance.settings import ComplianceSettings

ROLES = ("system", "user", "assistant")
PREFIX = "datasets/"
SHOWN_PROBLEMS = 20


class DatasetError(ApplianceError):
    """A dataset that cannot be imported; `problems` lists every bad row."""

    def __init__(self, message: str, problems: list[str] | None = None, **kwargs: Any) -> None:
        shown = problems[:SHOWN_PROBLEMS] if problems else []
        more = f"\n  ... and {len(problems) - len(shown)} more" if problems and len(problems) > len(shown) else ""
        super().__init__(message + "".join(f"\n  {p}" for p in shown) + more, **kwargs)
        self.problems = problems or []


@dataclass(frozen=True)
class Row:
    line: int
    example: dict[str, Any]  # {"messages": [...]} or {"text": ...}


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
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{path}: cannot read as UTF-8 text: {exc}") from exc
    if path.suffix == ".txt":
        return _paragraphs(path, text)
    rows, problems = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            example = normalise(json.loads(line))
        except ValueError as exc:
            problems.append(f"line {number}: {exc}")
            continue
        rows.append(Row(number, example))
    if problems:
        raise DatasetError(f"{path}: {len(problems)} bad rows, nothing imported:", problems)
    if not rows:
        raise DatasetError(f"{path}: no rows")
    kinds = {kind(row.example) for row in rows}
    if len(kinds) > 1:
        first = rows[0]
        other = next(row for row in rows if kind(row.example) != kind(first.example))
        raise DatasetError(f"{path}: line {first.line} holds {kind(first.example)} and line {other.line} "
                           f"{kind(other.example)}: a dataset holds SFT rows or preference rows, not both")
    return rows


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
    problems = [f"line {row.line}: {tokens} tokens after the chat template, over the {context}-token context"
                for row in rows if (tokens := count_tokens(row.example)) > context]
    if problems:
        raise DatasetError(f"{len(problems)} rows are too long, nothing imported:", problems)


def screen(rows: list[Row], settings: ComplianceSettings) -> tuple[list[Row], dict[str, int]]:
    """`scan` with the scanner the gateway screens with too and the action for training data, as
    the `compliance` settings say."""
    return scan(rows, scanner_from(settings), settings.training_data)


def scan(rows: list[Row], scanner: Scanner, action: str) -> tuple[list[Row], dict[str, int]]:
    """Counts of sensitive findings by kind; under 'block' any finding refuses the dataset (naming
    lines and kinds, never the text), under 'redact' they are replaced."""
    found: list[tuple[int, str]] = []
    for row in rows:
        for text in _texts(row.example):
            found += [(row.line, finding.kind) for finding in scanner.findings(text)]
    counts = dict(Counter(kind for _, kind in found))
    if found and action == "block":
        problems = [f"line {line}: {kind}" for line, kind in found]
        raise DatasetError(f"sensitive data found ({', '.join(f'{k}: {n}' for k, n in sorted(counts.items()))}); "
                           "nothing imported (compliance.training_data = block; remove it, or set it to redact "
                           "or allow):", problems)
    if found and action == "redact":
        rows = [Row(row.line, _redacted(row.example, scanner)) for row in rows]
    return rows, counts


def _texts(example: dict[str, Any]) -> list[str]:
    if "text" in example:
        return [example["text"]]
    return [m["content"] for turns in example.values() for m in turns]


def _redacted(example: dict[str, Any], scanner: Scanner) -> dict[str, Any]:
    if "text" in example:
        return {"text": scanner.redact(example["text"])}
    return {field: [{**m, "content": scanner.redact(m["content"])} for m in turns] for field, turns in example.items()}


def split(rows: list[Row], eval_fraction: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Train and eval rows, chosen by each row's hash: reproducible and order-independent."""
    keyed = sorted((hashlib.sha256(_line(row.example)).hexdigest(), row.example) for row in rows)
    cut = round(len(keyed) * eval_fraction)
    if eval_fraction > 0 and len(keyed) > 1:
        cut = max(cut, 1)
    return [e for _, e in keyed[cut:]], [e for _, e in keyed[:cut]]


def _line(example: dict[str, Any]) -> bytes:
    return json.dumps(example, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()


def content_digest(train: bytes, evaluation: bytes) -> str:
    """A dataset's identity: SHA-256 of its train and eval files."""
    return hashlib.sha256(train + b"\0" + evaluation).hexdigest()


def check_dataset(name: str, digest: str, train: bytes, evaluation: bytes) -> None:
    """Raise IntegrityError unless the files read back from the store are the dataset recorded."""
    found = content_digest(train, evaluation)
    if found != digest:
        raise IntegrityError(f"dataset {name!r} in the artifact store was changed since it was added "
                             f"(its files hash to {found[:16]}..., recorded {digest[:16]}...)",
                             hint=f"add the dataset again with `appliance data add FILE --name {name}`")


def store(name: str, source: Path, train: list[dict[str, Any]], evaluation: list[dict[str, Any]],
          sensitive: dict[str, int],
          action: str, artifacts: ArtifactStore, home: Home) -> Imported:
    """Put the dataset in the store under its content hash and name it in the local registry."""
    done = put(name, source, train, evaluation, sensitive, action, artifacts)
    register(home, {name: done.digest})
    return done


def put(name: str, source: Path, train: list[dict[str, Any]], evaluation: list[dict[str, Any]],
        sensitive: dict[str, int], action: str, artifacts: ArtifactStore) -> Imported:
    """Put a dataset's files in the store under its content hash (not named yet: `register`)."""
    train_bytes = b"".join(_line(e) + b"\n" for e in train)
    eval_bytes = b"".join(_line(e) + b"\n" for e in evaluation)
    digest = content_digest(train_bytes, eval_bytes)
    rows = len(train) + len(evaluation)
    meta = {"name": name, "sha256": digest, "source": source.name, "rows": rows,
            "train": len(train), "eval": len(evaluation), "sensitive": sensitive, "sensitive_action": action,
            "created": datetime.now(UTC).isoformat(timespec="seconds")}
    for key, data in (("train.jsonl", train_bytes), ("eval.jsonl", eval_bytes),
                      ("meta.json", json.dumps(meta, indent=1).encode())):
        artifacts.put(f"{PREFIX}{digest}/{key}", data, retain_days=0)
    return Imported(name=name, digest=digest, rows=rows, train=len(train), eval=len(evaluation),
                    sensitive=sensitive, action=action)


def register(home: Home, names: dict[str, str]) -> None:
    """Name datasets (name -> digest) in the local registry, all in one change (the CLI and the
    rl-worker both add datasets)."""
    with _registry(home).change() as registry:
        registry.update(names)


def registry_path(home: Home) -> Path:
    return home.root / "datasets.json"


def _registry(home: Home) -> JsonRegistry[dict[str, str]]:
    return JsonRegistry(registry_path(home), dict[str, str], "the dataset registry", mode=0o644)


def load_registry(home: Home) -> dict[str, str]:
    """Dataset names -> the digests their files are stored under."""
    return _registry(home).read()
