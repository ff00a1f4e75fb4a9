"""A run's durable state: one SQLite file in the run's directory, shared by the run's loop and its
sandbox workers (separate processes).

- `executions` is the micro-task queue (a table of the appliance's work queue, appliance.queue): a
  program and its tests, queued -> running (claimed by a worker, with its pid) -> done (its
  verdict). A row held by a worker that died goes back to the queue (the loop looks every second
  and when a run resumes); a verdict is stored only by the worker holding the row, once, so a
  result is never lost and never written twice. Each row has the key of its attempt: enqueueing is
  idempotent.
- `generations` keeps each answer as it arrives (a resumed run does not ask the model again).
- `attempts` keeps each executed answer with its reward (appliance.rl.attempts.Attempt), and the number of
  the trajectory segment it went into.
- `policy_steps` keeps a GRPO run's finished updates: the version each trained, and its figures.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from appliance.queue import Alive, immediate
from appliance.rl import executions
from appliance.rl.attempts import Attempt
from appliance.rl.executions import ExecutionState
from appliance.rl.progress import PolicyStep
from appliance.rl.tasks import Task
from finetune.rl.execute import Verdict, not_run

SCHEMA = """
create table if not exists executions (
    id integer primary key autoincrement,
    key text not null unique,          -- the attempt's (appliance.rl.attempts.attempt_key)
    program text not null,
    task text not null,                -- JSON appliance.rl.tasks.Task
    state text not null default 'queued',
    worker_pid integer,
    claims integer not null default 0,
    verdict text,                      -- JSON finetune.rl.execute.Verdict
    queued_at real,                    -- when it was first queued (Unix time; the queue's metrics)
    lease_until real,                  -- appliance.queue: the worker's claim holds until then (null: while it lives)
    progress_at real                   -- appliance.queue: the claim, or its claimer's last progress since
);
create index if not exists executions_state on executions (state);
create table if not exists generations (
    key text primary key,
    messages text not null,            -- JSON
    completion text not null,
    code text not null,
    seconds real not null,
    model text not null,               -- the engine's name for what answered (an adapter's: name-vN)
    refused text,                      -- why the gateway would not answer this request, if it would not
    tokens integer                     -- the answer's tokens, as the engine counted them
);
create table if not exists attempts (
    key text primary key,
    attempt text not null,             -- JSON appliance.rl.attempts.Attempt
    segment integer                    -- the trajectory segment it is in; null: not yet in one
);
create table if not exists policy_steps (
    step integer primary key,          -- a GRPO run's update (finetune.rl.policy): 0, 1, ...
    figures text not null              -- JSON appliance.rl.progress.PolicyStep
);
create table if not exists segments (
    number integer primary key,
    key text,                          -- its object's key in the artifact store, once it is there
    sha256 text,
    attempts integer not null
);
"""


def _given_up(claims: int, state: ExecutionState) -> tuple[ExecutionState, dict[str, object]]:
    return ExecutionState.DONE, {"verdict": not_run(f"its sandbox worker died {claims} times running it")
                                 .model_dump_json()}


# A dead worker's execution waits again, until its workers died GIVE_UP_CLAIMS times running it.
EXECUTIONS = executions.queue(_given_up)


@dataclass(frozen=True)
class Execution:
    id: int
    key: str
    program: str
    task: Task
    claims: int


@dataclass(frozen=True)
class Generation:
    messages: list[dict[str, str]]
    completion: str
    code: str
    seconds: float
    model: str
    refused: str | None = None
    tokens: int | None = None  # the answer's tokens, as the engine counted them


def _create(path: Path) -> None:
    """Make the store at `path` with its tables, so that no reader sees the file before they are in
    it (the queue metrics open it without creating it, an operator read-only): built beside it, then
    linked into place; if another process put one there first, theirs is kept."""
    building = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.new")
    building.unlink(missing_ok=True)  # left by a process of this pid that died building it
    try:
        db = sqlite3.connect(building, isolation_level=None)
        try:
            db.execute("pragma journal_mode=wal")
            db.executescript(SCHEMA)
        finally:
            db.close()
        try:
            os.link(building, path)
        except FileExistsError:
            pass
    finally:
        building.unlink(missing_ok=True)


class RunStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._connections = threading.local()
        self._opened: list[sqlite3.Connection] = []
        if not path.exists():
            _create(path)
        with self._connect() as db:
            db.executescript(SCHEMA)
            with immediate(db):
                EXECUTIONS.migrate(db)
                if "queued_at" not in {row[1] for row in db.execute("pragma table_info(executions)")}:
                    db.execute("alter table executions add column queued_at real")  # a run from before it
                if "tokens" not in {row[1] for row in db.execute("pragma table_info(generations)")}:
                    db.execute("alter table generations add column tokens integer")  # a run from before it

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        """This thread's connection, kept: closing the last connection to a WAL database checkpoints
        it, and a sandbox worker's claims and verdicts come every few milliseconds."""
        db: sqlite3.Connection | None = getattr(self._connections, "db", None)
        if db is None:
            # Used by this thread only; closed by whichever thread closes the store.
            db = sqlite3.connect(self.path, timeout=60, isolation_level=None, check_same_thread=False)
            db.row_factory = sqlite3.Row
            db.execute("pragma journal_mode=wal")
            self._connections.db = db
            self._opened.append(db)
        yield db

    def close(self) -> None:
        """Close every thread's connection (the store is not used after)."""
        for db in self._opened:
            db.close()
        self._opened.clear()
        self._connections = threading.local()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._connect() as db, immediate(db):
            yield db

    # The queue.

    def enqueue(self, key: str, program: str, task: Task) -> None:
        with self._connect() as db:
            db.execute("insert or ignore into executions (key, program, task, queued_at) values (?, ?, ?, ?)",
                       (key, program, task.model_dump_json(), time.time()))

    def claim(self, worker_pid: int) -> Execution | None:
        """The oldest queued execution, for this worker (a dead worker's go back to the queue first:
        requeue_orphans)."""
        with self._transaction() as db:
            execution_id = EXECUTIONS.claim(db, worker_pid)
            if execution_id is None:
                return None
            row = db.execute("select * from executions where id = ?", (execution_id,)).fetchone()
        return Execution(id=row["id"], key=row["key"], program=row["program"],
                         task=Task.model_validate_json(row["task"]), claims=row["claims"])

    def requeue_orphans(self, alive: Alive) -> int:
        """Executions held by a worker that is gone back to the queue (the pool starts workers for
        queued ones); how many. One whose workers died GIVE_UP_CLAIMS times (it kills them, or the
        host does) is done: an error."""
        with self._transaction() as db:
            return EXECUTIONS.requeue_orphans(db, alive)

    def release(self, execution_id: int, worker_pid: int) -> None:
        """Give an execution back to the queue (its worker could not run it)."""
        with self._transaction() as db:
            EXECUTIONS.release(db, execution_id, worker_pid)

    def complete(self, execution_id: int, worker_pid: int, verdict: Verdict) -> bool:
        """Store the verdict if this worker still holds the execution (false: another took it over)."""
        with self._transaction() as db:
            return EXECUTIONS.finish(db, execution_id, ExecutionState.DONE, holder=worker_pid,
                                     verdict=verdict.model_dump_json())

    def verdicts(self, keys: set[str]) -> dict[str, Verdict]:
        """The verdicts reached so far among `keys`."""
        found: dict[str, Verdict] = {}
        ordered = sorted(keys)
        with self._connect() as db:
            for start in range(0, len(ordered), 500):  # under SQLite's limit on parameters
                chunk = ordered[start:start + 500]
                rows = db.execute(f"select key, verdict from executions where state = 'done' and key in "
                                  f"({', '.join('?' * len(chunk))})", chunk).fetchall()
                found.update((row["key"], Verdict.model_validate_json(row["verdict"])) for row in rows)
        return found

    def depth(self) -> int:
        """Executions waiting for a worker (held ones not counted)."""
        with self._connect() as db:
            return int(db.execute("select count(*) from executions where state = 'queued'").fetchone()[0])

    def unfinished(self) -> int:
        with self._connect() as db:
            return int(db.execute("select count(*) from executions where state != 'done'").fetchone()[0])

    # Generations and attempts.

    def save_generation(self, key: str, generation: Generation) -> None:
        with self._connect() as db:
            db.execute("insert or ignore into generations (key, messages, completion, code, seconds, model, refused, "
                       "tokens) values (?, ?, ?, ?, ?, ?, ?, ?)",
                       (key, json.dumps(generation.messages), generation.completion, generation.code,
                        generation.seconds, generation.model, generation.refused, generation.tokens))

    def generations(self) -> dict[str, Generation]:
        with self._connect() as db:
            return {row["key"]: Generation(json.loads(row["messages"]), row["completion"], row["code"],
                                           row["seconds"], row["model"], row["refused"], row["tokens"])
                    for row in db.execute("select * from generations")}

    def save_attempt(self, attempt: Attempt) -> None:
        with self._connect() as db:
            db.execute("insert or ignore into attempts (key, attempt) values (?, ?)",
                       (attempt.key, attempt.model_dump_json()))

    def attempts(self) -> list[Attempt]:
        with self._connect() as db:
            return [Attempt.model_validate_json(row["attempt"])
                    for row in db.execute("select attempt from attempts order by rowid")]

    def save_policy_step(self, figures: PolicyStep) -> None:
        with self._connect() as db:
            db.execute("insert into policy_steps values (?, ?)", (figures.step, figures.model_dump_json()))

    def policy_steps(self, last: int = -1) -> list[PolicyStep]:
        """A GRPO run's finished updates (the `last` of them; -1: all), in order."""
        with self._connect() as db:
            rows = db.execute("select figures from (select step, figures from policy_steps order by step desc "
                              "limit ?) order by step", (last,)).fetchall()
        return [PolicyStep.model_validate_json(row["figures"]) for row in rows]

    def policy_steps_done(self) -> int:
        with self._connect() as db:
            return int(db.execute("select count(*) from policy_steps").fetchone()[0])

    # Trajectory segments: attempts are given a segment number first, then the segment is put.

    def seal_segment(self, at_least: int) -> int | None:
        """Give the attempts not yet in a segment the next number, if there are `at_least` of them."""
        with self._transaction() as db:
            waiting = db.execute("select count(*) from attempts where segment is null").fetchone()[0]
            if waiting == 0 or waiting < at_least:
                return None
            number = int(db.execute("select coalesce(max(number), 0) + 1 from segments").fetchone()[0])
            db.execute("update attempts set segment = ? where segment is null", (number,))
            db.execute("insert into segments (number, attempts) values (?, ?)", (number, waiting))
            return number

    def unput_segments(self) -> list[int]:
        with self._connect() as db:
            return [row[0] for row in db.execute("select number from segments where key is null order by number")]

    def segment_lines(self, number: int) -> bytes:
        with self._connect() as db:
            rows = db.execute("select attempt from attempts where segment = ? order by key", (number,)).fetchall()
        return b"".join(row[0].encode() + b"\n" for row in rows)

    def segment_put(self, number: int, key: str, sha256: str) -> None:
        with self._connect() as db:
            db.execute("update segments set key = ?, sha256 = ? where number = ?", (key, sha256, number))

    def segments(self) -> list[dict[str, object]]:
        with self._connect() as db:
            return [dict(row) for row in db.execute("select * from segments where key is not null order by number")]
