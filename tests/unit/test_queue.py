"""The one work queue (appliance.queue) on its own: checked moves, one claimer per item even when
processes claim at once, leases and their heartbeat, a dead claimer's work taken over or put back,
bounded retries, and a finish that is idempotent."""

from __future__ import annotations

import multiprocessing
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from multiprocessing.queues import SimpleQueue
from multiprocessing.synchronize import Barrier
from pathlib import Path

import pytest

from appliance import queue
from appliance.errors import IllegalTransition, NotFound
from appliance.queue import LEASE_COLUMN, PROGRESS_COLUMN, Lifecycle, Queue, immediate


class State(StrEnum):
    WAITING = "waiting"
    WORKING = "working"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


LIFECYCLE = Lifecycle("item", {
    State.WAITING: frozenset({State.WORKING, State.CANCELLED}),
    State.WORKING: frozenset({State.WORKING, State.WAITING, State.SUCCEEDED, State.FAILED}),
    **{end: frozenset() for end in (State.SUCCEEDED, State.FAILED, State.CANCELLED)},
})
SCHEMA = """
create table if not exists items (
    id integer primary key autoincrement,
    state text not null default 'waiting',
    worker_pid integer,
    attempts integer not null default 0,
    started text,
    message text,
    lease_until real
);
"""


def given_up(times: int, state: State) -> tuple[State, dict[str, object]]:
    return State.FAILED, {"message": f"its workers died {times} times"}


def items(*, resume: bool = True, bound: int | None = None) -> Queue[State]:
    return Queue(table="items", lifecycle=LIFECYCLE, waiting=State.WAITING, taken=State.WORKING,
                 held=frozenset({State.WORKING}), orphans_resume=resume, max_attempts=bound,
                 give_up=given_up if bound else None)


@contextmanager
def transaction(path: Path) -> Iterator[sqlite3.Connection]:
    with queue.connect(path, SCHEMA, items()) as db, immediate(db):
        yield db


def added(path: Path, count: int) -> list[int]:
    with transaction(path) as db:
        return [int(db.execute("insert into items default values").lastrowid or 0) for _ in range(count)]


def row(path: Path, key: int) -> sqlite3.Row:
    with transaction(path) as db:
        found: sqlite3.Row = db.execute("select * from items where id = ?", (key,)).fetchone()
        return found


def test_moves_follow_the_lifecycle_and_an_illegal_one_names_the_item_its_state_and_the_move(tmp_path: Path) -> None:
    path = tmp_path / "q.sqlite"
    [first, second] = added(path, 2)
    assert LIFECYCLE.ended == {State.SUCCEEDED, State.FAILED, State.CANCELLED}
    with transaction(path) as db:
        items().move(db, first, State.CANCELLED, message="not wanted")
    with pytest.raises(IllegalTransition, match=f"item {first} has already been cancelled: it cannot become working"):
        with transaction(path) as db:
            items().move(db, first, State.WORKING, message="kept?")
    with pytest.raises(IllegalTransition, match=f"item {second} is waiting: it cannot become succeeded"):
        with transaction(path) as db:
            items().move(db, second, State.SUCCEEDED)
    with pytest.raises(NotFound, match="no item 99"):
        with transaction(path) as db:
            items().move(db, 99, State.WORKING)
    assert row(path, first)["message"] == "not wanted"  # nothing an illegal move tried was kept


def claim_all(path: Path, holder: int, start: Barrier, results: SimpleQueue[tuple[int, list[int]]]) -> None:
    start.wait()
    taken = []
    while True:
        with transaction(path) as db:
            key = items().claim(db, holder, alive=lambda pid: True)
        if key is None:
            break
        taken.append(int(key))
    results.put((holder, taken))


@pytest.mark.integration
def test_processes_claiming_at_once_never_get_the_same_item(tmp_path: Path) -> None:
    path = tmp_path / "q.sqlite"
    keys = added(path, 60)
    context = multiprocessing.get_context("fork")
    start, results = context.Barrier(3), context.SimpleQueue()
    claimers = [context.Process(target=claim_all, args=(path, holder, start, results)) for holder in (101, 102, 103)]
    for claimer in claimers:
        claimer.start()
    claimed = dict(results.get() for _ in claimers)
    for claimer in claimers:
        claimer.join(30)
    assert sorted(key for taken in claimed.values() for key in taken) == keys  # each item once, to one claimer
    for holder, taken in claimed.items():
        assert all(row(path, key)["worker_pid"] == holder for key in taken)


def test_a_dead_claimers_item_is_taken_over_in_its_state_or_waits_again(tmp_path: Path) -> None:
    path = tmp_path / "q.sqlite"
    [key] = added(path, 1)
    with transaction(path) as db:
        assert items().claim(db, 1, alive=lambda pid: True, first={"started": "then"}) == key
        assert items().claim(db, 2, alive=lambda pid: True) is None  # its claimer lives
        assert items().claim(db, 2, alive=lambda pid: pid != 1, first={"started": "now"}) == key  # taken over
    taken = row(path, key)
    assert (taken["state"], taken["worker_pid"], taken["attempts"], taken["started"]) == ("working", 2, 2, "then")
    with transaction(path) as db:
        assert items(resume=False).requeue_orphans(db, lambda pid: True) == 0
        assert items(resume=False).requeue_orphans(db, lambda pid: pid != 2) == 1
    assert (row(path, key)["state"], row(path, key)["worker_pid"]) == ("waiting", None)


def test_a_lease_runs_out_unless_its_claimer_beats(tmp_path: Path) -> None:
    path = tmp_path / "q.sqlite"
    [first, second] = added(path, 2)
    with transaction(path) as db:
        assert items(resume=False).claim(db, 1, lease_s=-1) == first  # a lease already run out
        assert items(resume=False).claim(db, 2, lease_s=-1) == second
        assert items().heartbeat(db, second, 2, lease_s=60)
        assert not items().heartbeat(db, second, 3, lease_s=60)  # not its claim
        assert items(resume=False).requeue_orphans(db, lambda pid: True) == 1  # alive, but silent too long
    assert row(path, first)["state"] == "waiting" and row(path, first)[LEASE_COLUMN] is None
    assert row(path, second)["state"] == "working"
    with transaction(path) as db:
        assert items().release(db, second, 2, message="could not run it")
        assert not items().release(db, second, 2)  # not held any more
        assert not items().heartbeat(db, second, 2, lease_s=60)
    assert (row(path, second)["state"], row(path, second)["message"]) == ("waiting", "could not run it")


def test_an_item_held_without_progress_is_stuck_until_its_claimer_stamps_progress(tmp_path: Path) -> None:
    path = tmp_path / "q.sqlite"
    [first, second, third] = added(path, 3)
    with transaction(path) as db:
        for holder in (1, 2):
            assert items().claim(db, holder) is not None
        db.execute(f"update items set {PROGRESS_COLUMN} = {PROGRESS_COLUMN} - 100")  # claimed 100 s ago
        assert items().progressed(db, second, 2)
        assert not items().progressed(db, first, 2), "another's claim"
        assert not items().progressed(db, third, 3), "not held"
        [stuck] = items().stuck(db, idle_s=50)
        assert (stuck.key, stuck.holder, stuck.attempts) == (first, 1, 1) and 99 < stuck.idle_s < 110
        assert items().stuck(db, idle_s=200) == []
        db.execute(f"update items set {PROGRESS_COLUMN} = null where id = ?", (first,))  # claimed before stamps
        assert items().stuck(db, idle_s=50) == []
        assert items().release(db, second, 2)
    assert row(path, second)[PROGRESS_COLUMN] is None, "a released item's stamp goes with its claim"
    with transaction(path) as db:
        assert items().claim(db, 4) == second
    assert row(path, second)[PROGRESS_COLUMN] is not None, "a claim is the first stamp"


def test_a_claimer_stopped_as_asked_hands_its_attempt_back(tmp_path: Path) -> None:
    path = tmp_path / "q.sqlite"
    [key] = added(path, 1)
    bounded = items(bound=2)
    for holder in range(1, 6):  # five stops asked for (down, up): none counts against the bound
        with transaction(path) as db:
            assert bounded.claim(db, holder, alive=lambda pid: False) == key
            assert bounded.hand_back(db, holder) == 1
            assert bounded.hand_back(db, holder + 100) == 0, "not its claim"
    assert (row(path, key)["state"], row(path, key)["attempts"]) == ("working", 0)


def test_retries_are_bounded_and_the_item_fails_saying_so(tmp_path: Path) -> None:
    path = tmp_path / "q.sqlite"
    [key] = added(path, 1)
    bounded = items(resume=False, bound=2)
    for holder in (1, 2):
        with transaction(path) as db:
            assert bounded.claim(db, holder) == key
            assert bounded.requeue_orphans(db, lambda pid: False) == 1
    assert (row(path, key)["state"], row(path, key)["message"]) == ("failed", "its workers died 2 times")
    [other] = added(path, 1)
    taking_over = items(bound=1)
    with transaction(path) as db:
        assert taking_over.claim(db, 1, alive=lambda pid: True) == other
        assert taking_over.claim(db, 2, alive=lambda pid: False) == other  # given up, for its claimer to report
    assert (row(path, other)["state"], row(path, other)["worker_pid"]) == ("failed", None)


def test_finishing_again_in_the_same_state_changes_nothing_and_another_end_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "q.sqlite"
    [key] = added(path, 1)
    with transaction(path) as db:
        assert items().claim(db, 7, alive=lambda pid: True) == key
        with pytest.raises(IllegalTransition, match=f"item {key} cannot finish as working"):
            items().finish(db, key, State.WORKING)
        assert not items().finish(db, key, State.SUCCEEDED, holder=8, message="not mine")  # another's claim
        assert items().finish(db, key, State.SUCCEEDED, holder=7, message="succeeded")
        assert not items().finish(db, key, State.SUCCEEDED, message="again")
        assert not items().finish(db, key, State.FAILED, holder=7, message="late")  # no longer held
    with pytest.raises(IllegalTransition, match=f"item {key} has already succeeded: it cannot become failed"):
        with transaction(path) as db:
            items().finish(db, key, State.FAILED, message="another end")
    ended = row(path, key)
    assert (ended["state"], ended["message"], ended["worker_pid"]) == ("succeeded", "succeeded", None)


def test_a_table_made_before_leases_gains_the_columns(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as db:
        db.execute("create table items (id integer primary key, state text not null default 'waiting', "
                   "worker_pid integer, attempts integer not null default 0, started text, message text)")
        db.execute("insert into items default values")
    with transaction(path) as db:
        assert items().claim(db, 1, lease_s=60) == 1
        assert row_lease(db) is not None
        assert items().progressed(db, 1, 1)


def row_lease(db: sqlite3.Connection) -> float | None:
    lease: float | None = db.execute(f"select {LEASE_COLUMN} from items").fetchone()[0]
    return lease
