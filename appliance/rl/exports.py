"""The queue of exports: datasets asked of a finished RL run's trajectories (the admin API asks,
the rl-worker makes them; `appliance rl export` makes them at once)."""

from __future__ import annotations

import sqlite3
from contextlib import AbstractContextManager

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from appliance import queue
from appliance.errors import Conflict
from appliance.home import Home
from appliance.jobs import FINISHED, MOVES, STATE_COLUMNS, SUBMITTED_AT, JobState, claimed, database, name_problem, now
from appliance.queue import Alive, Lifecycle, Queue
from appliance.rl import runs

SCHEMA = f"""
create table if not exists rl_exports (
    id integer primary key autoincrement,
    run_id integer not null,       -- the RL run whose trajectories it reads
    sft text,                      -- the SFT dataset to make, if asked for
    dpo text,                      -- the preference dataset to make, if asked for
{STATE_COLUMNS}
);
"""
GIVE_UP_TAKES = 3  # an export whose workers died this many times while making it fails


def _given_up(takes: int, state: JobState) -> tuple[JobState, dict[str, object]]:
    return JobState.FAILED, {"message": f"the rl-worker died {takes} times making it", "finished": now()}


# An export left by a worker that died is made again by the next, up to GIVE_UP_TAKES times.
EXPORTS = Queue(table="rl_exports", lifecycle=Lifecycle("export", MOVES), waiting=JobState.QUEUED,
                taken=JobState.RUNNING, held=frozenset({JobState.RUNNING}), max_attempts=GIVE_UP_TAKES,
                give_up=_given_up, waiting_since=SUBMITTED_AT)


class ExportAsk(BaseModel):
    """Datasets to make from a finished run's trajectories (held-out tasks left out)."""

    model_config = ConfigDict(extra="forbid")

    sft: str | None = Field(None, max_length=64, description="The SFT set: passing attempts.")
    dpo: str | None = Field(None, max_length=64,
                            description="The preference set: passing vs failing first answers at the same task.")

    @field_validator("sft", "dpo")
    @classmethod
    def _a_name(cls, value: str | None) -> str | None:
        if value is not None and (problem := name_problem(value)):
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _something(self) -> ExportAsk:
        if self.sft is None and self.dpo is None:
            raise ValueError("name the SFT set, the preference (DPO) set or both")
        if self.sft == self.dpo:
            raise ValueError("the SFT and preference sets need two names")
        return self


class Export(ExportAsk):
    """An export asked of the rl-worker (the admin API's; `appliance rl export` makes them at once)."""

    model_config = ConfigDict(extra="ignore")

    id: int
    run_id: int
    state: JobState
    submitted: str
    started: str | None
    finished: str | None
    attempts: int = Field(description="Times a worker took it up.")
    worker_pid: int | None
    message: str | None


def connect(home: Home) -> AbstractContextManager[sqlite3.Connection]:
    """A connection to the exports' table and the runs' (`queue.immediate(db)` blocks are transactions)."""
    return queue.connect(database(home), runs.SCHEMA + SCHEMA, runs.RUNS, EXPORTS)


def transaction(home: Home) -> AbstractContextManager[sqlite3.Connection]:
    return queue.transaction(database(home), runs.SCHEMA + SCHEMA, runs.RUNS, EXPORTS)


def _export(db: sqlite3.Connection, export_id: int) -> Export:
    return Export.model_validate(dict(EXPORTS.row(db, export_id)))


def default_ask(run_id: int) -> ExportAsk:
    """The datasets an export is asked for when no names are given (the TUI's)."""
    return ExportAsk(sft=f"rl-run-{run_id}-sft", dpo=f"rl-run-{run_id}-dpo")


def ask(home: Home, run_id: int, asked: ExportAsk) -> Export:
    """Queue an export of a run that ended with its trajectories written, unless one of it is
    queued or running already (Conflict)."""
    with transaction(home) as db:
        run = runs.read(db, run_id)
        if run.state not in FINISHED:
            raise Conflict(f"RL run {run_id} is {run.state}: it can be exported once it has ended",
                           hint="`appliance rl status` shows where it is")
        if runs.manifest_digest(home, run_id) is None:
            raise Conflict(f"RL run {run_id} ended without writing its trajectories: there is nothing to export",
                           hint="`appliance rl status` says how it ended")
        busy = db.execute("select id from rl_exports where run_id = ? and state in ('queued', 'running')",
                          (run_id,)).fetchone()
        if busy is not None:
            raise Conflict(f"export {busy['id']} of RL run {run_id} is not finished yet",
                           hint=f"GET /admin/rl/exports/{busy['id']} follows it")
        cursor = db.execute("insert into rl_exports (run_id, sft, dpo, state, submitted) values (?, ?, ?, 'queued', ?)",
                            (run_id, asked.sft, asked.dpo, now()))
        return _export(db, int(cursor.lastrowid or 0))


def get(home: Home, export_id: int) -> Export:
    with connect(home) as db:
        return _export(db, export_id)


def listing(home: Home) -> list[Export]:
    with connect(home) as db:
        return [Export.model_validate(dict(row)) for row in EXPORTS.rows(db)]


def claim(home: Home, worker_pid: int, alive: Alive) -> Export | None:
    """The next export for this worker: one whose worker died (made again), else the oldest queued.
    One whose workers died GIVE_UP_TAKES times is failed instead, and returned so, for the worker
    to report."""
    with transaction(home) as db:
        row = claimed(db, EXPORTS, worker_pid, alive)
    return None if row is None else Export.model_validate(dict(row))


def finish(home: Home, export_id: int, worker_pid: int, state: JobState, message: str) -> bool:
    """Record how an export ended, if this worker still holds it (False: another took it over, or
    it has ended)."""
    with transaction(home) as db:
        return EXPORTS.finish(db, export_id, state, holder=worker_pid, message=message[:1000], finished=now())
