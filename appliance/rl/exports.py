"""The queue of exports: datasets asked of a finished RL run's trajectories (the admin API asks,
the rl-worker makes them; `appliance rl export` makes them at once)."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from datetime import UTC, datetime

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from appliance.errors import Conflict, IllegalTransition, NotFound
from appliance.home import Home
from appliance.jobs import FINISHED, JobState, check_move, claimable, connect, name_problem, transaction
from appliance.rl import runs


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


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _export(db: sqlite3.Connection, export_id: int) -> Export:
    row = db.execute("select * from rl_exports where id = ?", (export_id,)).fetchone()
    if row is None:
        raise NotFound(f"no export {export_id}")
    return Export.model_validate(dict(row))


def default_ask(run_id: int) -> ExportAsk:
    """The datasets an export is asked for when no names are given (the TUI's)."""
    return ExportAsk(sft=f"rl-run-{run_id}-sft", dpo=f"rl-run-{run_id}-dpo")


def ask(home: Home, run_id: int, asked: ExportAsk) -> Export:
    """Queue an export of a run that ended with its trajectories written, unless one of it is
    queued or running already (Conflict)."""
    with transaction(home) as db:
        run = runs._get(db, run_id)
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
                            (run_id, asked.sft, asked.dpo, _now()))
        return _export(db, int(cursor.lastrowid or 0))


def get(home: Home, export_id: int) -> Export:
    with connect(home) as db:
        return _export(db, export_id)


def listing(home: Home) -> list[Export]:
    with connect(home) as db:
        return [Export.model_validate(dict(row)) for row in db.execute("select * from rl_exports order by id")]


def claim(home: Home, worker_pid: int, alive: Callable[[int | None], bool]) -> Export | None:
    """The next export for this worker: one whose worker died (done again), else the oldest queued."""
    with transaction(home) as db:
        row = claimable(db, "rl_exports", alive)
        if row is None:
            return None
        check_move(f"export {row['id']}", row["state"], JobState.RUNNING)
        db.execute("update rl_exports set state = 'running', worker_pid = ?, attempts = attempts + 1, "
                   "started = coalesce(started, ?) where id = ?", (worker_pid, _now(), row["id"]))
        return _export(db, row["id"])


def finish(home: Home, export_id: int, worker_pid: int, state: JobState, message: str) -> bool:
    """Record how an export ended, if this worker still holds it (False: another took it over)."""
    if state not in FINISHED:
        raise IllegalTransition(f"export {export_id} cannot finish as {state}")
    with transaction(home) as db:
        export = _export(db, export_id)
        if export.worker_pid != worker_pid:
            return False
        check_move(f"export {export_id}", export.state, state)
        db.execute("update rl_exports set state = ?, message = ?, finished = ?, worker_pid = null where id = ?",
                   (state, message[:1000], _now(), export_id))
        return True
