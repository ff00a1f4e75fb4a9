"""The training job queue: one SQLite table in the state dir, shared by `appliance finetune
submit|status|cancel`, the supervised `finetune-worker` and the admin API. A job's files (its data,
checkpoints, progress and result) live in its own directory; the row holds its state."""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from appliance.errors import ApplianceError
from appliance.home import Home

JobState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
FINISHED = ("succeeded", "failed", "cancelled")
CANCEL_FILE = "cancel"  # in the job's directory: the runner stops the trainer
PROGRESS_FILE = "progress.json"  # in the job's directory: the trainer's latest report
SCHEMA = """
create table if not exists jobs (
    id integer primary key autoincrement,
    name text not null,            -- the adapter's name
    data text not null,            -- the dataset's name
    base text not null,            -- 'demo' or a checkpoint directory
    hyperparameters text not null, -- JSON
    eval_sets text not null,       -- JSON: kind -> items (finetune.evalsets)
    state text not null,
    submitted text not null,
    started text,
    finished text,
    attempts integer not null default 0,
    worker_pid integer,
    trainer_pid integer,           -- the sandboxed training process
    message text                   -- the outcome, or why it failed
)"""


class Job(BaseModel):
    id: int
    name: str
    data: str
    base: str
    hyperparameters: dict
    eval_sets: dict[str, list[dict]]
    state: JobState
    submitted: str
    started: str | None
    finished: str | None
    attempts: int
    worker_pid: int | None
    trainer_pid: int | None
    message: str | None


@dataclass(frozen=True)
class Progress:
    """The trainer's latest report."""

    step: int
    max_steps: int
    loss: float | None
    tokens_per_s: float
    eta_s: float | None


def jobs_dir(home: Home) -> Path:
    return home.root / "finetune" / "jobs"


def job_dir(home: Home, job_id: int) -> Path:
    return jobs_dir(home) / str(job_id)


@contextmanager
def connect(home: Home) -> Iterator[sqlite3.Connection]:
    """A connection in autocommit mode; `with db:` blocks are transactions."""
    jobs_dir(home).mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(jobs_dir(home) / "jobs.sqlite", timeout=30, isolation_level=None)
    db.row_factory = sqlite3.Row
    try:
        db.execute("pragma journal_mode=wal")
        db.execute(SCHEMA)
        yield db
    finally:
        db.close()


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _job(row: sqlite3.Row) -> Job:
    return Job(**{**dict(row), "hyperparameters": json.loads(row["hyperparameters"]),
                  "eval_sets": json.loads(row["eval_sets"])})


def submit(home: Home, *, name: str, data: str, base: str, hyperparameters: dict,
           eval_sets: dict[str, list[dict]]) -> Job:
    with connect(home) as db:
        cursor = db.execute("insert into jobs (name, data, base, hyperparameters, eval_sets, state, submitted) "
                            "values (?, ?, ?, ?, ?, 'queued', ?)",
                            (name, data, base, json.dumps(hyperparameters), json.dumps(eval_sets), _now()))
        return get(home, int(cursor.lastrowid or 0))


def get(home: Home, job_id: int) -> Job:
    with connect(home) as db:
        row = db.execute("select * from jobs where id = ?", (job_id,)).fetchone()
    if row is None:
        raise ApplianceError(f"no training job {job_id}", hint="`appliance finetune status` lists them")
    return _job(row)


def listing(home: Home) -> list[Job]:
    with connect(home) as db:
        return [_job(row) for row in db.execute("select * from jobs order by id")]


def claim(home: Home, worker_pid: int, alive: Callable[[int | None], bool]) -> Job | None:
    """The next job for this worker: one left running by a worker that died (it resumes from its
    last checkpoint), else the oldest queued one."""
    with connect(home) as db:
        db.execute("begin immediate")
        try:
            rows = db.execute("select * from jobs where state = 'running' order by id").fetchall()
            orphan = next((row for row in rows if not alive(row["worker_pid"])), None)
            row = orphan or db.execute("select * from jobs where state = 'queued' order by id limit 1").fetchone()
            if row is None:
                db.execute("commit")
                return None
            db.execute("update jobs set state = 'running', worker_pid = ?, attempts = attempts + 1, "
                       "started = coalesce(started, ?) where id = ?", (worker_pid, _now(), row["id"]))
            db.execute("commit")
        except BaseException:
            db.execute("rollback")
            raise
    return get(home, row["id"])


def set_trainer(home: Home, job_id: int, pid: int) -> None:
    with connect(home) as db:
        db.execute("update jobs set trainer_pid = ? where id = ?", (pid, job_id))


def finish(home: Home, job_id: int, state: JobState, message: str) -> None:
    with connect(home) as db:
        db.execute("update jobs set state = ?, message = ?, finished = ?, worker_pid = null, trainer_pid = null "
                   "where id = ?",
                   (state, message, _now(), job_id))


def cancel(home: Home, job_id: int) -> Job:
    """A queued job is cancelled at once; a running one is stopped by its worker (within a second)."""
    job = get(home, job_id)
    if job.state in FINISHED:
        raise ApplianceError(f"training job {job_id} has already {'ended' if job.state != 'cancelled' else 'been'} "
                             f"{job.state}")
    directory = job_dir(home, job_id)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CANCEL_FILE).touch()
    with connect(home) as db:
        db.execute("update jobs set state = 'cancelled', message = 'cancelled before it started', finished = ? "
                   "where id = ? and state = 'queued'", (_now(), job_id))
    return get(home, job_id)



def write_progress(directory: Path, progress: Progress) -> None:
    """Replace the job's progress report atomically (readers poll it)."""
    partial = directory / f".{PROGRESS_FILE}.partial"
    partial.write_text(json.dumps(asdict(progress)))
    os.replace(partial, directory / PROGRESS_FILE)


def read_progress(directory: Path) -> Progress | None:
    """The job's latest progress report, if it has made one."""
    try:
        return Progress(**json.loads((directory / PROGRESS_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None
