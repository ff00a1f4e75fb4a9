"""The watchdog's look at the work queues (appliance.work_queues): a worker that holds an item (a
training job, an RL run, a batch request or validation) with no progress for its queue's stall
limit is ended through the same kill as a wedged engine, and supervisord starts it again. Its items
are then orphans like a crashed worker's (appliance.queue): the new worker resumes a job or a run
and sends batch work again, and gives an item up after MAX_ATTEMPTS workers. Each worker ended is
an audit record naming each item, how long it made no progress, and its attempt."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass

from appliance.changes import Change, Target
from appliance.errors import ApplianceError
from appliance.home import Home
from appliance.queue import Stuck
from appliance.settings import WatchdogSettings
from appliance.supervisor import ProcessInfo, ProcessState, Supervisor
from appliance.work_queues import WORK_QUEUES, WorkQueue

ACTOR = "watchdog"
log = logging.getLogger(ACTOR)


@dataclass(frozen=True)
class StuckItem:
    work: WorkQueue
    item: Stuck
    target: Target

    def describe(self) -> str:
        what = self.work.queue.lifecycle.noun
        names = self.target.name if self.target.name == str(self.item.key) else f"{self.item.key} of " \
                f"{self.target.kind} {self.target.name}"
        return f"{what} {names}: no progress for {self.item.idle_s:.0f} s (attempt {self.item.attempts})"


def stuck_items(home: Home, settings: WatchdogSettings) -> list[StuckItem]:
    """Every item held past its queue's stall limit. A queue that cannot be read is skipped (and
    logged): it is judged at the next look."""
    found: list[StuckItem] = []
    for work in WORK_QUEUES:
        if work.stall_s is None:
            continue
        try:
            with work.connect(home) as db:
                found += [StuckItem(work, item, work.target(db, item.key))
                          for item in work.queue.stuck(db, work.stall_s(settings))]
        except (sqlite3.Error, ApplianceError, OSError) as exc:
            log.warning("queue %s not readable: %s", work.name, exc)
    return found


def end_stuck_workers(home: Home, settings: WatchdogSettings, supervisor: Supervisor,
                      kill: Callable[[int], None], record: Callable[[Change], None]) -> None:
    """End each worker that holds a stuck item: only a program supervisord runs as that queue's
    worker under the claim's pid (a dead claimer's items are already orphans; any other pid is
    never touched), checked again just before the kill."""
    stuck = stuck_items(home, settings)
    if not stuck:
        return
    running = {info.pid: info for info in supervisor.processes()
               if info.state == ProcessState.RUNNING and info.pid > 1}
    by_holder: dict[int, list[StuckItem]] = {}
    for found in stuck:
        info = running.get(found.item.holder)
        if info is not None and info.name == found.work.worker:
            by_holder.setdefault(info.pid, []).append(found)
    for pid, items in by_holder.items():
        name = running[pid].name
        current = ProcessInfo.from_rpc(supervisor.call("getProcessInfo", name))
        if current.state != ProcessState.RUNNING or current.pid != pid:
            continue  # it ended or was started again meanwhile: the pid is no longer the worker's
        log.warning("ending %s (pid %d): %s", name, pid, "; ".join(found.describe() for found in items))
        kill(pid)
        by_target: dict[Target, list[StuckItem]] = {}
        for found in items:  # one record per object: a batch's requests together
            by_target.setdefault(found.target, []).append(found)
        for target, found_items in by_target.items():
            detail = (f"{name} (pid {pid}) ended: " + "; ".join(found.describe() for found in found_items[:5]) +
                      (f"; and {len(found_items) - 5} more" if len(found_items) > 5 else "") +
                      "; taken over when supervisord has started it again")
            record(Change(f"{target.kind}.requeued", "allowed", 0, target, detail, actor=ACTOR))
