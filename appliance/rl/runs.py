"""The queue of RL runs: one table of the appliance's work queue (appliance.queue) in the training
jobs' database, moved by the jobs' state machine (appliance.jobs.MOVES). A run's attempts,
executions and progress live in the run's own directory (finetune.rl.store, appliance.rl.progress)."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from appliance import queue
from appliance.durable import replace_file
from appliance.errors import NotFound
from appliance.home import Home
from appliance.jobs import CANCEL_FILE, HELD, MOVES, JobState, database
from appliance.queue import Alive, Lifecycle, Queue

SCHEMA = """
create table if not exists rl_runs (
    id integer primary key autoincrement,
    spec text not null,            -- JSON: RunSpec
    state text not null,           -- JobState, moved by MOVES as jobs are
    submitted text not null,
    started text,
    finished text,
    attempts integer not null default 0,
    worker_pid integer,
    message text,
    lease_until real               -- appliance.queue: the worker's claim holds until then (null: while it lives)
);
"""
# A run left by a worker that died is taken over in its state: it resumes from what it has done.
RUNS = Queue(table="rl_runs", lifecycle=Lifecycle("RL run", MOVES), waiting=JobState.QUEUED,
             taken=JobState.RUNNING, held=HELD)


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


@contextmanager
def connect(home: Home) -> Iterator[sqlite3.Connection]:
    """A connection to the runs' table (`queue.immediate(db)` blocks are transactions)."""
    with queue.connect(database(home), SCHEMA, RUNS) as db:
        yield db


@contextmanager
def transaction(home: Home) -> Iterator[sqlite3.Connection]:
    with connect(home) as db, queue.immediate(db):
        yield db


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _run(row: sqlite3.Row) -> Run:
    return Run(**{**dict(row), "spec": json.loads(row["spec"])})


def submit(home: Home, spec: RunSpec) -> Run:
    with connect(home) as db:
        cursor = db.execute("insert into rl_runs (spec, state, submitted) values (?, 'queued', ?)",
                            (spec.model_dump_json(), _now()))
        return read(db, int(cursor.lastrowid or 0))


def get(home: Home, run_id: int) -> Run:
    with connect(home) as db:
        return read(db, run_id)


def read(db: sqlite3.Connection, run_id: int) -> Run:
    """A run, read in the caller's transaction; NotFound if there is none."""
    row = db.execute("select * from rl_runs where id = ?", (run_id,)).fetchone()
    if row is None:
        raise NotFound(f"no RL run {run_id}", hint="`appliance rl status` lists them")
    return _run(row)


def listing(home: Home) -> list[Run]:
    with connect(home) as db:
        return [_run(row) for row in db.execute("select * from rl_runs order by id")]


def claim(home: Home, worker_pid: int, alive: Alive) -> Run | None:
    """The next run for this worker: one whose worker died (it resumes), else the oldest queued."""
    with transaction(home) as db:
        run_id = RUNS.claim(db, worker_pid, alive=alive, first={"started": _now()})
        return None if run_id is None else read(db, int(run_id))


def finish(home: Home, run_id: int, state: JobState, message: str) -> None:
    """End a run (again as it ended: nothing changes; otherwise: IllegalTransition)."""
    with transaction(home) as db:
        RUNS.finish(db, run_id, state, message=message, finished=_now())


def note(home: Home, run_id: int, message: str) -> None:
    """Say what a running run is doing (its worker waits to resume it, say), for `rl status`."""
    with connect(home) as db:
        db.execute("update rl_runs set message = ? where id = ? and state = 'running'", (message[:1000], run_id))


def cancel(home: Home, run_id: int) -> Run:
    """A queued run is cancelled at once; a running one becomes `cancelling` and its worker stops
    it between attempts (what is done stays in its trajectories)."""
    with transaction(home) as db:
        if read(db, run_id).state == JobState.QUEUED:
            RUNS.move(db, run_id, JobState.CANCELLED, message="cancelled before it started", finished=_now())
        else:
            RUNS.move(db, run_id, JobState.CANCELLING, message="cancel requested")
            directory = run_dir(home, run_id)
            directory.mkdir(parents=True, exist_ok=True)
            (directory / CANCEL_FILE).touch()
        return read(db, run_id)


def manifest_digest(home: Home, run_id: int) -> str | None:
    """The SHA-256 of the trajectory manifest the run wrote when it ended (None before)."""
    try:
        return (run_dir(home, run_id) / MANIFEST_DIGEST_FILE).read_text().strip() or None
    except OSError:
        return None


def record_manifest_digest(home: Home, run_id: int, sha256: str) -> None:
    run_dir(home, run_id).mkdir(parents=True, exist_ok=True)
    replace_file(run_dir(home, run_id) / MANIFEST_DIGEST_FILE, sha256.encode(), mode=0o644)
