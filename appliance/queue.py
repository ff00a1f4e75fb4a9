"""One work queue over a SQLite table, shared by every queue of the appliance (training jobs, RL
runs and exports, batch validations and requests, a run's sandbox executions): each keeps its own
table and record, and moves its items with this.

- A Lifecycle is a state enum with the table of its legal moves; every move is checked against it
  inside the write transaction that makes it, so two processes cannot both move an item, and an
  illegal move raises IllegalTransition naming the item, its state and the move.
- A claim gives one waiting item to one claimer (its pid, or any integer worker id its `alive`
  callback knows), with an optional lease that its heartbeat extends. An item is orphaned when its
  claimer is not alive or its lease ran out: a queue either takes orphans over in their state (a
  training job resumes from its checkpoint) or puts them back to wait (a sandbox execution).
- A claimer stamps its item's progress (`progressed`; a claim is the first stamp): an item held by
  a living claimer with no progress for a while is stuck (`stuck`), and the watchdog ends its
  claimer so that the item is an orphan like any other.
- Retries are bounded: an orphan whose claimers died `max_attempts` times is given up (ended, with
  a message saying so) instead of being handed on again. A claimer stopped as asked hands its
  attempt back (`hand_back`): only deaths count.
- Finishing is idempotent: an item finished again in the same state is left as it is; another end
  is refused (IllegalTransition), and a claimer that no longer holds the item finishes nothing.

Every method takes the caller's connection and runs in its transaction (`immediate`), so a queue's
own columns are written together with the move.
"""

from __future__ import annotations

import functools
import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Generic, TypeVar

from appliance.errors import IllegalTransition, NotFound

S = TypeVar("S", bound=StrEnum)
Key = int | str
Alive = Callable[[int | None], bool]  # whether an item's claimer still runs (None: no claimer)
LEASE_COLUMN = "lease_until"  # seconds since the epoch; null: the claim holds as long as its claimer lives
PROGRESS_COLUMN = "progress_at"  # seconds since the epoch: the claim, or the claimer's last progress since
CLAIMED_COLUMN = "claimed_at"  # seconds since the epoch: the item's first claim (how long it waited)
WAITS_WINDOW_S = 3600.0  # a queue's recent waits: of items first claimed this long ago at most...
MAX_WAITS = 10_000  # ...the latest this many


@dataclass(frozen=True)
class Lifecycle(Generic[S]):
    """The states an item goes through and the legal moves between them."""

    noun: str  # what an item is called in messages: "training job", "batch"
    moves: Mapping[S, frozenset[S]]

    @property
    def ended(self) -> frozenset[S]:
        """The states nothing leads out of."""
        return frozenset(state for state, moves in self.moves.items() if not moves)

    def check(self, key: Key, current: S, to: S) -> None:
        """IllegalTransition unless a move leads from `current` to `to`."""
        if to not in self.moves[current]:
            was = ("has already been cancelled" if current == "cancelled"
                   else f"has already {current}" if current in self.ended else f"is {current}")
            raise IllegalTransition(f"{self.noun} {key} {was}: it cannot become {to}")


@dataclass(frozen=True)
class Depth:
    """A queue at one moment (its metrics)."""

    waiting: int
    held: int
    oldest_waiting_s: float | None  # None: nothing waits, or the queue does not keep when items began to
    # How long each item first claimed in the last WAITS_WINDOW_S had waited (at most MAX_WAITS).
    recent_waits_s: tuple[float, ...] = ()


@dataclass(frozen=True)
class Stuck:
    """An item held with no progress for a while."""

    key: Key
    holder: int
    idle_s: float  # since its claim or its claimer's last progress
    attempts: int


@dataclass(frozen=True)
class Queue(Generic[S]):
    """A table of items moved by `lifecycle`: they wait in `waiting`, a claim moves one to `taken`,
    and a claimer holds it in any of the `held` states."""

    table: str
    lifecycle: Lifecycle[S]
    waiting: S
    taken: S
    held: frozenset[S]
    key: str = "id"  # "rowid" for a table whose key spans columns
    state: str = "state"
    holder: str = "worker_pid"
    attempts: str | None = "attempts"  # counts claims; None: the table does not
    orphans_resume: bool = True  # an orphan is taken over in its state; False: it waits again
    hint: str | None = None  # where a missing item's NotFound points the user
    max_attempts: int | None = None
    # An SQL expression over the table's row: the Unix time an item began to wait (None: not kept).
    waiting_since: str | None = None
    # How an item is given up once its claimers died `max_attempts` times: its end and the columns
    # saying why (given that number and the state it was left in).
    give_up: Callable[[int, S], tuple[S, Mapping[str, object]]] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if (self.max_attempts is None) != (self.give_up is None) or (self.max_attempts and not self.attempts):
            raise ValueError(f"queue {self.table}: max_attempts needs give_up and an attempts column")

    def migrate(self, db: sqlite3.Connection) -> None:
        """Add the lease, progress and claim columns to a table made before them, and index the
        claims (in the caller's transaction)."""
        columns = {row[1] for row in db.execute(f"pragma table_info({self.table})")}
        for column in (LEASE_COLUMN, PROGRESS_COLUMN, CLAIMED_COLUMN):
            if column not in columns:
                db.execute(f"alter table {self.table} add column {column} real")
        # The recent waits are read at each scrape: by this index, not the whole table.
        db.execute(f"create index if not exists {self.table}_{CLAIMED_COLUMN} on {self.table} ({CLAIMED_COLUMN})")

    def row(self, db: sqlite3.Connection, key: Key) -> sqlite3.Row:
        """An item's row; NotFound if there is no such item."""
        row: sqlite3.Row | None = db.execute(f"select * from {self.table} where {self.key} = ?", (key,)).fetchone()
        if row is None:
            raise NotFound(f"no {self.lifecycle.noun} {key}", hint=self.hint)
        return row

    def rows(self, db: sqlite3.Connection) -> list[sqlite3.Row]:
        """Every item's row, oldest first."""
        return db.execute(f"select * from {self.table} order by {self.key}").fetchall()

    def depth(self, db: sqlite3.Connection) -> Depth:
        """How many items wait and how many are held, and how long the oldest waiting one has waited."""
        since = self.waiting_since or "null"
        row = db.execute(f"select count(*), min({since}) from {self.table} where {self.state} = ?",
                         (self.waiting,)).fetchone()
        held = db.execute(f"select count(*) from {self.table} where {self.state} in ({_marks(self.held)})",
                          tuple(self.held)).fetchone()[0]
        now = time.time()
        oldest = None if row[1] is None else max(0.0, now - float(row[1]))
        waits: tuple[float, ...] = ()
        if self.waiting_since:
            waits = tuple(max(0.0, float(wait)) for (wait,) in db.execute(
                f"select {CLAIMED_COLUMN} - {self.waiting_since} from {self.table} where {CLAIMED_COLUMN} >= ? "
                f"and {self.waiting_since} is not null order by {CLAIMED_COLUMN} desc limit ?",
                (now - WAITS_WINDOW_S, MAX_WAITS)))
        return Depth(waiting=row[0], held=held, oldest_waiting_s=oldest, recent_waits_s=waits)

    def state_of(self, db: sqlite3.Connection, key: Key) -> S:
        """An item's state; NotFound if there is no such item."""
        return self._claim_of(db, key)[0]

    def move(self, db: sqlite3.Connection, key: Key, to: S, **columns: object) -> None:
        """Move an item to `to`, setting `columns`, if its lifecycle allows it; IllegalTransition
        otherwise."""
        self._move(db, key, self.state_of(db, key), to, columns)

    def claim(self, db: sqlite3.Connection, holder: int, *, alive: Alive | None = None, lease_s: float | None = None,
              first: Mapping[str, object] | None = None) -> Key | None:
        """The key of the item `holder` now holds: with `alive`, an orphan first (taken over, see
        Queue), else the oldest waiting one; None when there is neither. An orphan past the bound
        on retries is given up instead and its key returned, ended, for the caller to report.
        `first`: columns set on an item's first claim only (when it started)."""
        if alive is not None and self.orphans_resume:
            for orphan in self._orphans(db, alive):
                key: Key = orphan["key"]
                if self._spent(orphan):
                    self._give_up(db, orphan)
                else:
                    self.take(db, key, holder, lease_s=lease_s, first=first)
                return key
        row = db.execute(f"select {self.key} from {self.table} where {self.state} = ? order by {self.key} limit 1",
                         (self.waiting,)).fetchone()
        if row is None:
            return None
        key = row[0]
        self.take(db, key, holder, lease_s=lease_s, first=first)
        return key

    def take(self, db: sqlite3.Connection, key: Key, holder: int, *, lease_s: float | None = None,
             first: Mapping[str, object] | None = None) -> None:
        """Give `holder` the item: a waiting one is taken, a held one (an orphan) stays in its state."""
        current = self.state_of(db, key)
        to = current if current in self.held else self.taken
        self.lifecycle.check(key, current, to)
        columns: dict[str, object] = {self.state: to, self.holder: holder, LEASE_COLUMN: _lease(lease_s),
                                      PROGRESS_COLUMN: time.time()}
        counted = f", {self.attempts} = {self.attempts} + 1" if self.attempts else ""
        once_columns = {**(first or {}), CLAIMED_COLUMN: columns[PROGRESS_COLUMN]}
        once = "".join(f", {name} = coalesce({name}, ?)" for name in once_columns)
        db.execute(f"update {self.table} set {', '.join(f'{name} = ?' for name in columns)}{counted}{once} "
                   f"where {self.key} = ?", (*columns.values(), *once_columns.values(), key))

    def requeue_orphans(self, db: sqlite3.Connection, alive: Alive, given_up: list[Key] | None = None) -> int:
        """Orphans back to waiting (or given up, past the bound on retries, their keys added to
        `given_up`); how many."""
        orphans = self._orphans(db, alive)
        for row in orphans:
            if self._spent(row):
                self._give_up(db, row)
                if given_up is not None:
                    given_up.append(row["key"])
            else:
                self._move(db, row["key"], type(self.waiting)(row["state"]), self.waiting, self._unclaimed)
        return len(orphans)

    def heartbeat(self, db: sqlite3.Connection, key: Key, holder: int, lease_s: float) -> bool:
        """Extend the claim's lease by `lease_s` from now, if `holder` still holds the item."""
        return db.execute(f"update {self.table} set {LEASE_COLUMN} = ? where {self.key} = ? and {self.holder} = ? "
                          f"and {self.state} in ({_marks(self.held)})",
                          (_lease(lease_s), key, holder, *self.held)).rowcount == 1

    def hand_back(self, db: sqlite3.Connection, holder: int) -> int:
        """A claimer stopping as asked (SIGTERM: `down`, an upgrade) gives back the attempts of the
        items it holds: the next claimer takes them over without counting against the bound on
        retries, which is for claimers that died. How many."""
        if not self.attempts:
            return 0
        return db.execute(f"update {self.table} set {self.attempts} = max({self.attempts} - 1, 0) "
                          f"where {self.holder} = ? and {self.state} in ({_marks(self.held)})",
                          (holder, *self.held)).rowcount

    def progressed(self, db: sqlite3.Connection, key: Key, holder: int) -> bool:
        """Stamp the item's progress now, if `holder` still holds it."""
        return db.execute(f"update {self.table} set {PROGRESS_COLUMN} = ? where {self.key} = ? and {self.holder} = ? "
                          f"and {self.state} in ({_marks(self.held)})",
                          (time.time(), key, holder, *self.held)).rowcount == 1

    def stuck(self, db: sqlite3.Connection, idle_s: float) -> list[Stuck]:
        """Held items whose claim or last progress is more than `idle_s` old, oldest first (whether
        their claimer still lives is the caller's to judge; an item claimed before progress was
        stamped is never stuck)."""
        attempts = self.attempts or "0"
        now = time.time()
        rows = db.execute(f"select {self.key}, {self.holder}, {PROGRESS_COLUMN}, {attempts} from {self.table} "
                          f"where {self.state} in ({_marks(self.held)}) and {self.holder} is not null "
                          f"and {PROGRESS_COLUMN} < ? order by {self.key}", (*self.held, now - idle_s)).fetchall()
        return [Stuck(key=row[0], holder=row[1], idle_s=now - row[2], attempts=row[3]) for row in rows]

    def release(self, db: sqlite3.Connection, key: Key, holder: int | None, **columns: object) -> bool:
        """Give a held item back to wait, setting `columns`, if `holder` (None: whoever) holds it."""
        current, held_by = self._claim_of(db, key)
        if current not in self.held or (holder is not None and held_by != holder):
            return False
        self._move(db, key, current, self.waiting, {**self._unclaimed, **columns})
        return True

    def finish(self, db: sqlite3.Connection, key: Key, to: S, *, holder: int | None = None, **columns: object) -> bool:
        """End an item as `to`, setting `columns`; whether it did. With `holder`, only while that
        claimer holds it (another took it over, or it ended: False). An item already ended as `to`
        is left as it is (False); one ended otherwise refuses the move (IllegalTransition)."""
        if to not in self.lifecycle.ended:
            raise IllegalTransition(f"{self.lifecycle.noun} {key} cannot finish as {to}")
        current, held_by = self._claim_of(db, key)
        if (holder is not None and held_by != holder) or current == to:
            return False
        self._move(db, key, current, to, {**self._unclaimed, **columns})
        return True

    @property
    def _unclaimed(self) -> dict[str, object]:
        return {self.holder: None, LEASE_COLUMN: None, PROGRESS_COLUMN: None}

    def _claim_of(self, db: sqlite3.Connection, key: Key) -> tuple[S, int | None]:
        """An item's state and claimer; NotFound if there is no such item."""
        row = db.execute(f"select {self.state}, {self.holder} from {self.table} where {self.key} = ?",
                         (key,)).fetchone()
        if row is None:
            raise NotFound(f"no {self.lifecycle.noun} {key}", hint=self.hint)
        return type(self.waiting)(row[0]), row[1]

    def _move(self, db: sqlite3.Connection, key: Key, current: S, to: S, columns: Mapping[str, object]) -> None:
        self.lifecycle.check(key, current, to)
        self._set(db, key, {self.state: to, **columns})

    def _orphans(self, db: sqlite3.Connection, alive: Alive) -> list[sqlite3.Row]:
        """Held items whose claimer is gone (not alive, or its lease ran out), oldest first."""
        attempts = self.attempts or "0"
        rows = db.execute(f"select {self.key} as key, {self.state} as state, {self.holder} as holder, "
                          f"{attempts} as attempts, {LEASE_COLUMN} as lease from {self.table} "
                          f"where {self.state} in ({_marks(self.held)}) order by {self.key}", tuple(self.held))
        now, living = time.time(), functools.cache(alive)  # one look per claimer: it may read the process table
        return [row for row in rows if (row["lease"] is not None and row["lease"] < now) or not living(row["holder"])]

    def _spent(self, row: sqlite3.Row) -> bool:
        return self.max_attempts is not None and row["attempts"] >= self.max_attempts

    def _give_up(self, db: sqlite3.Connection, row: sqlite3.Row) -> None:
        assert self.give_up is not None  # _spent is true only with a bound, and __post_init__ pairs them
        state = type(self.waiting)(row["state"])
        end, columns = self.give_up(row["attempts"], state)
        self._move(db, row["key"], state, end, {**self._unclaimed, **columns})

    def _set(self, db: sqlite3.Connection, key: Key, columns: Mapping[str, object]) -> None:
        db.execute(f"update {self.table} set {', '.join(f'{name} = ?' for name in columns)} where {self.key} = ?",
                   (*columns.values(), key))


def _lease(lease_s: float | None) -> float | None:
    return None if lease_s is None else time.time() + lease_s


def _marks(values: frozenset[S]) -> str:
    return ", ".join("?" * len(values))


@contextmanager
def immediate(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """A write transaction on `db` (an autocommit connection), taken at once: no other writer
    between its read and its write."""
    db.execute("begin immediate")
    try:
        yield db
    except BaseException:
        if db.in_transaction:  # SQLite may have rolled back already (disk full, I/O): keep the real error
            db.execute("rollback")
        raise
    db.execute("commit")


_READY: set[tuple[Path, str]] = set()  # (database, schema) this process has made sure of


@contextmanager
def connect(path: Path, schema: str, *queues: Queue[Any]) -> Iterator[sqlite3.Connection]:
    """A connection to a queue database in autocommit mode (`immediate` blocks are transactions),
    its `schema` made and its queues' tables migrated once per process."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # The appliance's alone: made 0600 before SQLite would make it by the umask (its side files take its mode).
    os.close(os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))
    db = sqlite3.connect(path, timeout=30, isolation_level=None)
    try:
        db.row_factory = sqlite3.Row
        if (path, schema) not in _READY:
            path.chmod(0o600)  # one made before
            db.execute("pragma journal_mode=wal")
            db.executescript(schema)
            with immediate(db):  # two processes may open an old database at once
                for queue in queues:
                    queue.migrate(db)
            _READY.add((path, schema))
        yield db
    finally:
        db.close()


@contextmanager
def transaction(path: Path, schema: str, *queues: Queue[Any]) -> Iterator[sqlite3.Connection]:
    """A write transaction on a queue database (see connect)."""
    with connect(path, schema, *queues) as db, immediate(db):
        yield db
