"""The batch queue's database: one SQLite file in the state dir, its schema brought up to date once
per process, and the two work queues in it (the requests to run, the input files to validate)."""

from __future__ import annotations

import json
import secrets
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path

from appliance.errors import StateError
from appliance.home import Home
from appliance.queue import Lifecycle, Queue, immediate

SCHEMA = """
create table if not exists files (
    id text primary key,
    owner text not null,           -- the token subject that uploaded it (a batch's outputs: its owner's)
    filename text not null,
    purpose text not null,         -- batch (an input), batch_output
    bytes integer not null,
    created_at integer not null,
    key text not null              -- in the artifact store
);
create table if not exists batches (
    id text primary key,
    owner text not null,           -- the token subject that created it
    username text not null,
    roles text not null,           -- JSON: its owner's roles when created; its requests run with them
    endpoint text not null,
    input_file_id text not null,
    completion_window text not null,
    status text not null,
    errors text,                   -- JSON: OpenAI's errors object (a failed validation)
    output_file_id text,
    error_file_id text,
    created_at integer not null,
    in_progress_at integer, expires_at integer not null, finalizing_at integer, completed_at integer,
    failed_at integer, expired_at integer, cancelling_at integer, cancelled_at integer,
    total integer not null default 0,
    completed integer not null default 0,
    failed integer not null default 0,
    metadata text,                 -- JSON: the client's, up to 16 string pairs
    announced integer not null default 0,  -- its end is in the audit log
    validator_pid integer,         -- unused: validations are queued in batch_validations (a marker of this schema)
    input_bytes integer not null default 0,  -- its input file's size: validation work, counted per hour
    api_key text                   -- the API key it was made with: its requests stop when the key does
);
create table if not exists batch_requests (
    batch_id text not null,
    line integer not null,         -- in the input file, from 1
    custom_id text not null,
    body text not null,            -- JSON: the request's body
    state text not null,           -- pending, claimed, done
    worker_pid integer,
    status_code integer,
    request_id text,               -- the gateway's, in the request's audit record
    response text,                 -- JSON: the answer's body (both dropped once in the output file)
    retry_at integer,              -- given back (a budget spent, an engine down): not claimed before
    attempts integer not null default 0,  -- times given back after a failure that may pass
    claims integer not null default 0,    -- workers that took it and did not give it back (died holding it)
    lease_until real,              -- appliance.queue: the worker's claim holds until then (null: while it lives)
    progress_at real,              -- appliance.queue: the claim, or its claimer's last progress since
    primary key (batch_id, line)
);
create index if not exists batch_requests_state on batch_requests (state, batch_id);
create table if not exists batch_validations (
    batch_id text primary key,     -- a batch whose input file waits for the worker to check and copy it
    state text not null,           -- pending, claimed, done
    worker_pid integer,            -- the worker checking it
    attempts integer not null default 0,  -- workers that took it (each one past the first found the last dead)
    lease_until real,              -- appliance.queue: the worker's claim holds until then (null: while it lives)
    progress_at real               -- appliance.queue: the claim, or its claimer's last progress since
);
create index if not exists batch_validations_state on batch_validations (state);
create unique index if not exists batch_requests_custom_id on batch_requests (batch_id, custom_id);
"""
# What brings a queue made before a column to today's schema. Before the worker validated batches,
# failed batches were answered at creation and are not announced.
MIGRATIONS = {
    "validator_pid": ("alter table batches add column validator_pid integer",
                      "update batches set announced = 1 where status = 'failed'"),
    "input_bytes": ("alter table batches add column input_bytes integer not null default 0",),
    "api_key": ("alter table batches add column api_key text",),
}


class RequestState(StrEnum):
    PENDING = "pending"
    CLAIMED = "claimed"
    DONE = "done"


CLAIM_MOVES = {
    RequestState.PENDING: frozenset({RequestState.CLAIMED, RequestState.DONE}),
    RequestState.CLAIMED: frozenset({RequestState.PENDING, RequestState.DONE}),
    RequestState.DONE: frozenset(),
}
# A batch's requests and its validation wait from when the batch was made.
BATCH_CREATED_AT = "(select created_at from batches where batches.id = batch_id)"
# A dead worker's requests are pending again; the first answer to a request is kept, whoever gives
# it (a request given back may still be answered by the worker that had it). A request whose worker
# died MAX_REQUEST_CLAIMS times holding it fails (500 batch_worker_died) instead of killing every
# worker after it: one user's request must not stop everyone's batches.
MAX_REQUEST_CLAIMS = 3


def _request_given_up(claims: int, state: RequestState) -> tuple[RequestState, dict[str, object]]:
    return RequestState.DONE, {"status_code": 500, "response": json.dumps({"error": {
        "message": f"the batch worker died {claims} times running this request", "type": "server_error",
        "code": "batch_worker_died"}})}


REQUESTS = Queue(
    table="batch_requests", lifecycle=Lifecycle("batch request", CLAIM_MOVES),
    key="rowid", waiting=RequestState.PENDING, taken=RequestState.CLAIMED, held=frozenset({RequestState.CLAIMED}),
    attempts="claims", orphans_resume=False, waiting_since=BATCH_CREATED_AT, max_attempts=MAX_REQUEST_CLAIMS,
    give_up=_request_given_up)
# A batch's validation: a dead worker's is pending again, and the next worker starts it over; a file
# whose validation the worker died in MAX_VALIDATION_ATTEMPTS times fails its batch instead (a file
# that kills the worker must not stop everyone's batches for good).
MAX_VALIDATION_ATTEMPTS = 3
VALIDATIONS = Queue(
    table="batch_validations", lifecycle=Lifecycle("batch validation", CLAIM_MOVES),
    key="batch_id", waiting=RequestState.PENDING, taken=RequestState.CLAIMED, held=frozenset({RequestState.CLAIMED}),
    orphans_resume=False, max_attempts=MAX_VALIDATION_ATTEMPTS, give_up=lambda attempts, state: (RequestState.DONE, {}),
    waiting_since=BATCH_CREATED_AT)


def unix_time() -> int:
    """Now, in whole seconds since the epoch (OpenAI's timestamps)."""
    return int(time.time())


def new_id(prefix: str) -> str:
    """A new random id of a file or batch, with OpenAI's prefix."""
    return f"{prefix}{secrets.token_hex(12)}"


_READY: set[Path] = set()  # databases whose schema this process has made sure of


@contextmanager
def connect(home: Home) -> Iterator[sqlite3.Connection]:
    """The queue's database; StateError (naming it) when it cannot be used."""
    path = home.root / "batches.sqlite"
    try:
        db = sqlite3.connect(path, timeout=30, isolation_level=None)
    except sqlite3.Error as exc:
        raise StateError(f"batch queue {path}: {exc}") from exc
    try:
        db.row_factory = sqlite3.Row
        if path not in _READY:
            db.execute("pragma journal_mode=wal")
            db.executescript(SCHEMA)
            _migrate(db)
            path.chmod(0o600)  # prompts are in it
            _READY.add(path)
        yield db
    except sqlite3.Error as exc:
        raise StateError(f"batch queue {path}: {exc}") from exc
    finally:
        db.close()


def _migrate(db: sqlite3.Connection) -> None:
    with immediate(db):  # the gateway and the worker may both open an old queue at once
        columns = {row[1] for row in db.execute("pragma table_info(batches)")}
        for column, statements in MIGRATIONS.items():
            if column not in columns:
                for statement in statements:
                    db.execute(statement)
        REQUESTS.migrate(db)
        VALIDATIONS.migrate(db)
        if "claims" not in {row[1] for row in db.execute("pragma table_info(batch_requests)")}:
            db.execute("alter table batch_requests add column claims integer not null default 0")
        if "attempts" not in {row[1] for row in db.execute("pragma table_info(batch_validations)")}:
            db.execute("alter table batch_validations add column attempts integer not null default 0")
        # A queue made before validations were queued: its validating batches wait for a worker.
        db.execute("insert or ignore into batch_validations (batch_id, state) "
                   "select id, 'pending' from batches where status = 'validating'")


@contextmanager
def transaction(home: Home) -> Iterator[sqlite3.Connection]:
    """A write transaction on the queue's database."""
    with connect(home) as db, immediate(db):
        yield db
