"""The queue of RL runs: one SQLite table beside the training jobs', moved by the same state machine
(appliance.jobs.MOVES). A run's attempts, executions and progress live in the run's own directory
(finetune.rl.store, appliance.rl.progress)."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from appliance.durable import replace_file
from appliance.errors import IllegalTransition, NotFound
from appliance.home import Home
from appliance.jobs import CANCEL_FILE, FINISHED, JobState, check_move, claimable, connect, transaction


class RunSpec(BaseModel):
    """What a run does: `samples` answers per task, each corrected for up to `rounds` more turns."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tasks: str = Field(description="The task set's name.")
    tasks_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$", description="The task set as it was when "
                                     "the run was queued: a run (or its resumption) refuses another under its name.")
    split: Literal["train", "held_out", "all"] = "train"
    limit: int | None = Field(None, ge=1, description="Only the first this many tasks of the split.")
    base: str = Field(description="The served model generating (a pool's model name).")
    adapter: str | None = Field(None, description="An adapter of the registry to generate with.")
    samples: int = Field(2, ge=1, le=64)
    rounds: int = Field(1, ge=0, le=8, description="Self-correction turns after a failing answer.")
    max_tokens: int = Field(256, ge=1, le=8192)
    temperature: float = Field(0.8, ge=0, le=2)
    seed: int = 0


class Run(BaseModel):
    id: int
    spec: RunSpec
    state: JobState
    submitted: str
    started: str | None
    finished: str | None
    attempts: int = Field(description="Times a worker took it up (more than one: it was resumed).")
    worker_pid: int | None
    message: str | None


MANIFEST_DIGEST_FILE = "manifest.sha256"  # in the run's directory: its trajectory manifest's SHA-256


def runs_dir(home: Home) -> Path:
    return home.root / "finetune" / "rl-runs"


def run_dir(home: Home, run_id: int) -> Path:
    return runs_dir(home) / str(run_id)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _run(row: sqlite3.Row) -> Run:
    return Run(**{**dict(row), "spec": json.loads(row["spec"])})


def submit(home: Home, spec: RunSpec) -> Run:
    with connect(home) as db:
        cursor = db.execute("insert into rl_runs (spec, state, submitted) values (?, 'queued', ?)",
                            (spec.model_dump_json(), _now()))
        return _get(db, int(cursor.lastrowid or 0))


def get(home: Home, run_id: int) -> Run:
    with connect(home) as db:
        return _get(db, run_id)


def _get(db: sqlite3.Connection, run_id: int) -> Run:
    row = db.execute("select * from rl_runs where id = ?", (run_id,)).fetchone()
    if row is None:
        raise NotFound(f"no RL run {run_id}", hint="`appliance rl status` lists them")
    return _run(row)


def listing(home: Home) -> list[Run]:
    with connect(home) as db:
        return [_run(row) for row in db.execute("select * from rl_runs order by id")]


def _move(db: sqlite3.Connection, run_id: int, to: JobState, assignments: str, values: tuple[object, ...]) -> None:
    check_move(f"RL run {run_id}", _get(db, run_id).state, to)
    db.execute(f"update rl_runs set state = ?, {assignments} where id = ?", (to, *values, run_id))


def claim(home: Home, worker_pid: int, alive: Callable[[int | None], bool]) -> Run | None:
    """The next run for this worker: one whose worker died (it resumes), else the oldest queued."""
    with transaction(home) as db:
        row = claimable(db, "rl_runs", alive)
        if row is None:
            return None
        to = JobState.CANCELLING if row["state"] == JobState.CANCELLING else JobState.RUNNING
        _move(db, row["id"], to, "worker_pid = ?, attempts = attempts + 1, started = coalesce(started, ?)",
              (worker_pid, _now()))
        return _get(db, row["id"])


def finish(home: Home, run_id: int, state: JobState, message: str) -> None:
    if state not in FINISHED:
        raise IllegalTransition(f"RL run {run_id} cannot finish as {state}")
    with transaction(home) as db:
        _move(db, run_id, state, "message = ?, finished = ?, worker_pid = null", (message, _now()))


def note(home: Home, run_id: int, message: str) -> None:
    """Say what a running run is doing (its worker waits to resume it, say), for `rl status`."""
    with connect(home) as db:
        db.execute("update rl_runs set message = ? where id = ? and state = 'running'", (message[:1000], run_id))


def cancel(home: Home, run_id: int) -> Run:
    """A queued run is cancelled at once; a running one becomes `cancelling` and its worker stops
    it between attempts (what is done stays in its trajectories)."""
    with transaction(home) as db:
        if _get(db, run_id).state == JobState.QUEUED:
            _move(db, run_id, JobState.CANCELLED, "message = ?, finished = ?", ("cancelled before it started", _now()))
        else:
            _move(db, run_id, JobState.CANCELLING, "message = ?", ("cancel requested",))
            directory = run_dir(home, run_id)
            directory.mkdir(parents=True, exist_ok=True)
            (directory / CANCEL_FILE).touch()
        return _get(db, run_id)


def manifest_digest(home: Home, run_id: int) -> str | None:
    """The SHA-256 of the trajectory manifest the run wrote when it ended (None before)."""
    try:
        return (run_dir(home, run_id) / MANIFEST_DIGEST_FILE).read_text().strip() or None
    except OSError:
        return None


def record_manifest_digest(home: Home, run_id: int, sha256: str) -> None:
    run_dir(home, run_id).mkdir(parents=True, exist_ok=True)
    replace_file(run_dir(home, run_id) / MANIFEST_DIGEST_FILE, sha256.encode(), mode=0o644)
