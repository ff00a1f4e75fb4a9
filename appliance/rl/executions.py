"""RL executions: each RL run's micro-task queue (a program and its tests, run by the run's sandbox
workers: finetune.rl.store holds the table in the run's own database, finetune.rl.executor works
it). Its lifecycle lives here, in the core, so that the gateway's queue metrics can read every
running run's queue."""

from __future__ import annotations

import logging
import sqlite3
import stat
from collections.abc import Callable, Mapping
from enum import StrEnum
from pathlib import Path

from appliance.home import Home
from appliance.queue import MAX_WAITS, Depth, Lifecycle, Queue
from appliance.rl import runs

GIVE_UP_CLAIMS = 3  # an execution taken up this often without a verdict is ended as an error
STORE_FILE = "run.sqlite"  # in the run's directory (appliance.rl.runs.run_dir)
log = logging.getLogger(__name__)


class ExecutionState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


def queue(give_up: Callable[[int, ExecutionState], tuple[ExecutionState, Mapping[str, object]]] | None = None
          ) -> Queue[ExecutionState]:
    """The executions' queue; with `give_up` (how a spent execution ends: the store's), bounded to
    GIVE_UP_CLAIMS claims, else as read by the metrics."""
    return Queue(
        table="executions",
        lifecycle=Lifecycle("execution", {
            ExecutionState.QUEUED: frozenset({ExecutionState.RUNNING}),
            ExecutionState.RUNNING: frozenset({ExecutionState.QUEUED, ExecutionState.DONE}),
            ExecutionState.DONE: frozenset(),
        }),
        waiting=ExecutionState.QUEUED, taken=ExecutionState.RUNNING, held=frozenset({ExecutionState.RUNNING}),
        attempts="claims", orphans_resume=False, waiting_since="queued_at",
        max_attempts=GIVE_UP_CLAIMS if give_up else None, give_up=give_up)


READING = queue()  # what the metrics read of a run's queue


def store_path(home: Home, run_id: int) -> Path:
    return runs.run_dir(home, run_id) / STORE_FILE


def depth(home: Home) -> Depth:
    """Every running RL run's executions together: waiting, held, the oldest waiting's age and the
    recent waits (sqlite3.Error or OSError where the runs' table cannot be read; a run whose own
    database cannot be read is left out, and logged)."""
    with runs.connect(home) as db:
        running = [row[0] for row in db.execute(f"select id from {runs.RUNS.table} where state = ?",
                                                (runs.RUNS.taken,))]
    total = Depth(waiting=0, held=0, oldest_waiting_s=None)
    for run_id in running:
        try:
            found = _run_depth(store_path(home, run_id))
        except (sqlite3.Error, OSError) as exc:
            log.warning("RL run %s: its executions not readable for metrics: %s", run_id, exc)
            continue
        if found is None:
            continue
        ages = [age for age in (total.oldest_waiting_s, found.oldest_waiting_s) if age is not None]
        total = Depth(waiting=total.waiting + found.waiting, held=total.held + found.held,
                      oldest_waiting_s=max(ages) if ages else None,
                      recent_waits_s=(total.recent_waits_s + found.recent_waits_s)[:MAX_WAITS])
    return total


def _run_depth(path: Path) -> Depth | None:
    """One run's executions; None before it queued any. Only a plain file is opened (never a link
    followed), never created, and waited on for a moment at most (a scrape must not hang on it)."""
    try:
        if not stat.S_ISREG(path.lstat().st_mode):
            raise OSError(f"{path} is not a plain file")
    except FileNotFoundError:
        return None
    store = sqlite3.connect(f"file:{path}?mode=rw", uri=True, timeout=0.5)
    try:
        return READING.depth(store)
    finally:
        store.close()
