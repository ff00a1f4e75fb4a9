"""The appliance's work queues in one list (each is an appliance.queue.Queue over a table of its
own): the name their metrics carry, their database, the supervised program that works them, and
how long an item may be held without progress before the watchdog ends that worker."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from appliance import batches, jobs
from appliance.changes import Target
from appliance.home import Home
from appliance.queue import Key, Queue, immediate
from appliance.rl import exports, runs
from appliance.settings import WatchdogSettings

log = logging.getLogger(__name__)
Connect = Callable[[Home], AbstractContextManager[sqlite3.Connection]]


@dataclass(frozen=True)
class WorkQueue:
    name: str  # the `queue` label of its series
    connect: Connect
    queue: Queue[Any]
    worker: str  # the supervised program that claims its items
    target_kind: str  # what the audit log calls the object an item belongs to...
    target_name: str  # ...and an SQL expression over the item's row naming it
    stall_s: Callable[[WatchdogSettings], float] | None = None  # None: the watchdog does not judge it

    def target(self, db: sqlite3.Connection, key: Key) -> Target:
        """The object the item belongs to (a request's batch), as the audit log names it."""
        row = db.execute(f"select {self.target_name} from {self.queue.table} where {self.queue.key} = ?",
                         (key,)).fetchone()
        return Target(kind=self.target_kind, name=str(key if row is None else row[0]))


WORK_QUEUES = (
    WorkQueue("finetune_jobs", jobs.connect, jobs.JOBS, "finetune-worker", "job", "id",
              lambda watchdog: watchdog.training_stall_s),
    WorkQueue("rl_runs", runs.connect, runs.RUNS, "rl-worker", "rl_run", "id", lambda watchdog: watchdog.rl_stall_s),
    WorkQueue("rl_exports", exports.connect, exports.EXPORTS, "rl-worker", "rl_export", "id"),
    WorkQueue("batch_requests", batches.connect, batches.REQUESTS, "batch-worker", "batch", "batch_id",
              lambda watchdog: watchdog.batch_stall_s),
    WorkQueue("batch_validations", batches.connect, batches.VALIDATIONS, "batch-worker", "batch", "batch_id",
              lambda watchdog: watchdog.batch_stall_s),
)


def hand_back(home: Home, program: str, pid: int) -> None:
    """Give back the attempts of the items `program` (this pid) holds in its queues."""
    for work in WORK_QUEUES:
        if work.worker == program:
            try:
                with work.connect(home) as db, immediate(db):
                    if handed := work.queue.hand_back(db, pid):
                        log.info("stopping: %d %s(s) handed back to the next worker", handed,
                                 work.queue.lifecycle.noun)
            except (sqlite3.Error, OSError) as exc:  # they count as a death, then: said, not hidden
                log.error("stopping: %s not handed back: %s", work.name, exc)
