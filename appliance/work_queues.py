"""The appliance's work queues in one list (each is an appliance.queue.Queue over a table of its
own): the name their metrics carry, their database, the supervised program that works them, and
how long an item may be held without progress before the watchdog ends that worker; and the one
life of those programs (`serve_worker`), with the one way a worker takes an item, does it and
tells the audit log how it ended (`ItemWork.take_one`)."""

from __future__ import annotations

import logging
import os
import signal
import sqlite3
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, NoReturn, Protocol, TypeVar

from appliance import batches, jobs
from appliance.changes import Change, Target, announce
from appliance.errors import ApplianceError
from appliance.home import Home
from appliance.queue import Key, Queue, immediate
from appliance.rl import exports, runs
from appliance.settings import Settings, WatchdogSettings, load_settings

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


Work = Callable[[Home, Settings], object]  # a worker's work, from its start until it is stopped


def serve_worker(program: str, work: Work) -> None:
    """A supervised queue worker's life (`program`, as WORK_QUEUES names it): `work` runs until
    SIGTERM unwinds it, so that what the work started (a trainer, sandbox workers) stops too, and
    the attempts of the items it held are handed back (a stop asked for is not a death)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    home = Home.from_env()
    try:
        work(home, load_settings(home.settings_file))
    except SystemExit:
        hand_back(home, program, os.getpid())
        raise


def one_at_a_time(work_one: Callable[[Home, Settings], object | None], poll_s: Callable[[Settings], float]) -> Work:
    """Work that takes items one at a time (`work_one`: None when there was none) until there is
    none, waits `poll_s`, and again."""
    def work(home: Home, settings: Settings) -> NoReturn:
        while True:
            if work_one(home, settings) is None:
                time.sleep(poll_s(settings))
    return work


class Item(Protocol):
    """What a worker's item has that taking it needs (a job, an RL run, an export)."""

    @property
    def id(self) -> int: ...
    @property
    def state(self) -> jobs.JobState: ...
    @property
    def message(self) -> str | None: ...


ItemT = TypeVar("ItemT", bound=Item)


class ItemWork(ABC, Generic[ItemT]):
    """One kind of item a worker takes one at a time: claimed, done, ended, and its end told once
    to the audit log (as `action`, on a target of `target_kind`, by `actor`), whoever ended it: an
    item the queue gave up (its workers died too often) is told as this worker finds it."""

    action: ClassVar[str]
    target_kind: ClassVar[str]
    actor: ClassVar[str]

    def __init__(self, home: Home, settings: Settings, log: logging.Logger) -> None:
        self.home = home
        self.settings = settings
        self.log = log

    @abstractmethod
    def claim(self) -> ItemT | None:
        """The next item for this worker, if any (one left by a dead worker first)."""

    @abstractmethod
    def work(self, item: ItemT) -> tuple[jobs.JobState, str]:
        """Do the item; how it ended and what to say of it."""

    @abstractmethod
    def finish(self, item: ItemT, state: jobs.JobState, message: str) -> bool:
        """End the item so; whether this ended it (False: it had ended, or another worker holds it)."""

    @abstractmethod
    def get(self, item: ItemT) -> ItemT:
        """The item as it is now."""

    @abstractmethod
    def describe(self, item: ItemT) -> str:
        """The item, for its end's record ("job 3 (coder on tickets)")."""

    def take_one(self) -> ItemT | None:
        """Take the next item, if any, and do it to its end; returns it as it ended."""
        item = self.claim()
        if item is None:
            return None
        if item.state in jobs.FINISHED:  # its workers died too often: the queue gave it up
            self.announce(item, item.state, item.message or "")
            return item
        state, message = self.work(item)
        if self.finish(item, state, message):
            self.announce(item, state, message)
        else:  # another worker ended it first: its outcome is the one the queue and the audit log keep
            self.log.warning("%s had already ended or was taken over; this worker's outcome (%s) is not recorded: "
                             "%s", self.describe(item), state, message)
        return self.get(item)

    def announce(self, item: ItemT, state: jobs.JobState, message: str) -> None:
        """The item's end in the audit log, as the CLI's changes are (one that cannot be recorded is
        logged: the work is done either way)."""
        detail = f"{self.describe(item)} {state}: {message}"
        succeeded = state == jobs.JobState.SUCCEEDED
        try:
            announce(Change(self.action, "allowed" if succeeded else "error", 0 if succeeded else 1,
                            Target(kind=self.target_kind, name=str(item.id)), detail if succeeded else None,
                            error=None if succeeded else detail, actor=self.actor))
        except ApplianceError as exc:
            self.log.error("%s (%s) not recorded in the audit log: %s", self.action, detail[:200], exc.one_line())
