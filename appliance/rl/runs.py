"""The queue of RL runs: one table of the appliance's work queue (appliance.queue) in the training
jobs' database, moved by the jobs' state machine (appliance.jobs.MOVES). A run's attempts,
executions and progress live in the run's own directory (finetune.rl.store, appliance.rl.progress)."""

from __future__ import annotations

import json
import sqlite3
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from appliance import queue
from appliance.durable import replace_file
from appliance.home import Home
from appliance.jobs import (
    HELD,
    MAX_ATTEMPTS,
    MOVES,
    STATE_COLUMNS,
    SUBMITTED_AT,
    JobState,
    claimed,
    database,
    given_up,
    now,
    request_cancel,
)
from appliance.queue import Alive, Lifecycle, Queue

SCHEMA = f"""
create table if not exists rl_runs (
    id integer primary key autoincrement,
    spec text not null,            -- JSON: RunSpec
{STATE_COLUMNS}
);
"""
# A run left by a worker that died is taken over in its state: it resumes from what it has done;
# one whose workers died MAX_ATTEMPTS times fails.
RUNS = Queue(table="rl_runs", lifecycle=Lifecycle("RL run", MOVES), waiting=JobState.QUEUED,
             taken=JobState.RUNNING, held=HELD, hint="`appliance rl status` lists them",
             waiting_since=SUBMITTED_AT, max_attempts=MAX_ATTEMPTS, give_up=given_up)


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


def connect(home: Home) -> AbstractContextManager[sqlite3.Connection]:
    """A connection to the runs' table (`queue.immediate(db)` blocks are transactions)."""
    return queue.connect(database(home), SCHEMA, RUNS)


def transaction(home: Home) -> AbstractContextManager[sqlite3.Connection]:
    return queue.transaction(database(home), SCHEMA, RUNS)


def _run(row: sqlite3.Row) -> Run:
    return Run(**{**dict(row), "spec": json.loads(row["spec"])})


def submit(home: Home, spec: RunSpec) -> Run:
    with connect(home) as db:
        cursor = db.execute("insert into rl_runs (spec, state, submitted) values (?, 'queued', ?)",
                            (spec.model_dump_json(), now()))
        return read(db, int(cursor.lastrowid or 0))


def get(home: Home, run_id: int) -> Run:
    with connect(home) as db:
        return read(db, run_id)


def read(db: sqlite3.Connection, run_id: int) -> Run:
    """A run, read in the caller's transaction; NotFound if there is none."""
    return _run(RUNS.row(db, run_id))


def listing(home: Home) -> list[Run]:
    with connect(home) as db:
        return [_run(row) for row in RUNS.rows(db)]


def claim(home: Home, worker_pid: int, alive: Alive) -> Run | None:
    """The next run for this worker: one whose worker died (it resumes), else the oldest queued."""
    with transaction(home) as db:
        row = claimed(db, RUNS, worker_pid, alive)
    return None if row is None else _run(row)


def finish(home: Home, run_id: int, state: JobState, message: str) -> bool:
    """End a run; whether this ended it (False: it had already ended so, and keeps what it said
    then; ended otherwise: IllegalTransition)."""
    with transaction(home) as db:
        return RUNS.finish(db, run_id, state, message=message, finished=now())


def progressed(home: Home, run_id: int, worker_pid: int) -> None:
    """The run made progress (the watchdog's stall clock starts again)."""
    with connect(home) as db:
        RUNS.progressed(db, run_id, worker_pid)


def note(home: Home, run_id: int, message: str) -> None:
    """Say what a running run is doing (its worker waits to resume it, say), for `rl status`."""
    with connect(home) as db:
        db.execute("update rl_runs set message = ? where id = ? and state = 'running'", (message[:1000], run_id))


def cancel(home: Home, run_id: int) -> Run:
    """A queued run is cancelled at once; a running one becomes `cancelling` and its worker stops
    it between attempts (what is done stays in its trajectories)."""
    with transaction(home) as db:
        request_cancel(db, RUNS, run_id, run_dir(home, run_id))
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
