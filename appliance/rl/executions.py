"""RL executions: each RL run's micro-task queue (a program and its tests, run by the run's sandbox
workers: finetune.rl.store holds the table in the run's own database, finetune.rl.executor works
it). Its lifecycle lives here, in the core, so that the gateway's queue metrics can read every
running run's queue."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Mapping
from enum import StrEnum
from pathlib import Path

from appliance.home import Home
from appliance.queue import MAX_WAITS, Depth, Lifecycle, Queue
from appliance.rl import runs

GIVE_UP_CLAIMS = 3  # an execution taken up this often without a verdict is ended as an error
STORE_FILE = "run.sqlite"  # in the run's directory (appliance.rl.runs.run_dir)


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


def store_path(home: Home, run_id: int) -> Path:
    return runs.run_dir(home, run_id) / STORE_FILE


def depth(home: Home) -> Depth:
    """Every running RL run's executions together: waiting, held, and the oldest waiting's age
    (sqlite3.Error or OSError where a run's database cannot be read)."""
    with runs.connect(home) as db:
        running = [row[0] for row in db.execute(f"select id from {runs.RUNS.table} where state = ?",
                                                (runs.RUNS.taken,))]
    reading, total = queue(), Depth(waiting=0, held=0, oldest_waiting_s=None)
    for run_id in running:
        path = store_path(home, run_id)
        if not path.is_file():
            continue  # the run has not queued anything yet
        store = sqlite3.connect(f"file:{path}?mode=rw", uri=True, timeout=5)  # never created here
        try:
            found = reading.depth(store)
        finally:
            store.close()
        ages = [age for age in (total.oldest_waiting_s, found.oldest_waiting_s) if age is not None]
        total = Depth(waiting=total.waiting + found.waiting, held=total.held + found.held,
                      oldest_waiting_s=max(ages) if ages else None,
                      recent_waits_s=(total.recent_waits_s + found.recent_waits_s)[:MAX_WAITS])
    return total
