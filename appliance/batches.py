"""The batch queue behind OpenAI's Batch API: files in the artifact store, batches and
their requests in one SQLite database in the state dir, shared by the gateway (which takes files,
creates, lists and cancels batches) and the supervised `batch-worker` (which validates their input
files and executes them through the gateway, so each request is routed, filtered, limited and
audited as any other).

A batch's life, as OpenAI's (every move checked against MOVES, its Lifecycle, inside the transaction
making it):

    validating --> in_progress --> finalizing --> completed | expired
       |    |           |                ^
       v    +------> cancel              |
     failed             v                |
                   cancelling -----------+--> cancelled

Creating a batch only checks what is cheap (the file, the quotas); the worker reads the input file
as a stream, checks it line by line and copies its requests into the queue, a chunk per
transaction, before the batch is in progress (or failed, naming each bad line).

Its requests are a table of the appliance's work queue (appliance.queue): pending, claimed by a
worker (its pid), or done with the engine's answer. A worker that dies leaves its claims to the
next one, so a request may run twice (at least once); the output file holds one line per request
all the same, in the input file's order.
"""

from __future__ import annotations

import io
import json
import math
import secrets
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, BinaryIO, Literal

from pydantic import BaseModel, Field

from appliance.artifacts import ArtifactStore, ArtifactStoreError, LocalStore, S3Store
from appliance.choices import prompt_count
from appliance.errors import Conflict, Invalid, NotFound, QuotaExceeded, StateError
from appliance.home import Home
from appliance.queue import Alive, Key, Lifecycle, Queue, immediate
from appliance.settings import BatchSettings

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
COMPLETION_WINDOWS = {"24h": 24 * 3600}
PURPOSE = "batch"
MAX_ERRORS = 100  # of an input file's faults, the first this many are named
CUSTOM_ID_MAX = 512
READ_BYTES = 1 << 20  # an input file is read this much at a time
CHUNK_ROWS, CHUNK_BYTES = 1000, 4 << 20  # requests copied into the queue per transaction, at most
SEEN_BITS = 1 << 23  # a filter of the custom_ids seen (1 MiB): most are new, and need no look-up
# The batch worker sends each request to the gateway with this header ("<batch id>:<line>") and the
# key kept under this secret's name: the gateway runs it as the batch's owner.
BATCH_HEADER = "x-appliance-batch-request"
BATCH_WORKER_SECRET = "batch-worker-key"
QUOTA_WINDOW_S = 3600  # batch.max_failed_validations_per_hour and max_validated_bytes_per_hour count over this


class BatchState(StrEnum):
    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FAILED = "failed"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


ENDED = (BatchState.FAILED, BatchState.COMPLETED, BatchState.EXPIRED, BatchState.CANCELLED)
MOVES: dict[BatchState, frozenset[BatchState]] = {
    BatchState.VALIDATING: frozenset({BatchState.IN_PROGRESS, BatchState.FAILED, BatchState.CANCELLING}),
    BatchState.IN_PROGRESS: frozenset({BatchState.FINALIZING, BatchState.CANCELLING}),
    BatchState.CANCELLING: frozenset({BatchState.FINALIZING}),
    BatchState.FINALIZING: frozenset({BatchState.COMPLETED, BatchState.EXPIRED, BatchState.CANCELLED}),
    **{state: frozenset() for state in ENDED},
}
BATCH_LIFECYCLE = Lifecycle("batch", MOVES)
# Which timestamp a move sets (OpenAI's field names).
STAMPS = {BatchState.IN_PROGRESS: "in_progress_at", BatchState.FAILED: "failed_at",
          BatchState.FINALIZING: "finalizing_at", BatchState.COMPLETED: "completed_at",
          BatchState.EXPIRED: "expired_at", BatchState.CANCELLING: "cancelling_at",
          BatchState.CANCELLED: "cancelled_at"}

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


class FileObject(BaseModel):
    """OpenAI's file object."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"


class ErrorEntry(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class Errors(BaseModel):
    object: Literal["list"] = "list"
    data: list[ErrorEntry]


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class Batch(BaseModel):
    """OpenAI's batch object."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: Errors | None = None
    input_file_id: str
    completion_window: str
    status: BatchState
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    metadata: dict[str, str] | None = None


class BatchAsk(BaseModel):
    """The body of POST /v1/batches."""

    model_config = {"extra": "forbid"}

    input_file_id: str = Field(max_length=64)
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: Literal["24h"]
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16)


@dataclass(frozen=True)
class Owner:
    """Who a batch runs for: its creator as their token said when they created it."""

    subject: str
    username: str
    roles: frozenset[str]
    key: str | None = None  # the API key it was made with, if one was


@dataclass(frozen=True)
class Claimed:
    """One request of a batch, claimed by a worker to execute."""

    batch_id: str
    line: int
    custom_id: str
    endpoint: str
    body: dict[str, Any]
    attempts: int = 0  # times it was given back after a failure that may pass

    @property
    def ref(self) -> str:
        """What the worker names it by to the gateway (X-Appliance-Batch-Request)."""
        return f"{self.batch_id}:{self.line}"


def _now() -> int:
    return int(time.time())


def new_id(prefix: str) -> str:
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


# -- files --------------------------------------------------------------------------------------


def add_file(home: Home, store: ArtifactStore, *, owner: str, filename: str, purpose: str,
             data: bytes | BinaryIO, limits: BatchSettings) -> FileObject:
    """Keep an uploaded file (bytes, or a seekable file copied to the store in pieces: an upload
    is never held whole in memory) within the owner's storage quota (their files, outputs
    included: they delete what they no longer need). Its row reserves the quota first and is
    removed again if the bytes cannot be stored."""
    if purpose != PURPOSE:
        raise Invalid(f"purpose {purpose[:64]!r}: only 'batch' files are accepted")
    size = len(data) if isinstance(data, bytes) else data.seek(0, io.SEEK_END)
    if not size:
        raise Invalid("the file is empty")
    file = FileObject(id=new_id("file-"), bytes=size, created_at=_now(), filename=_safe_name(filename),
                      purpose=purpose)
    key = f"batches/files/{file.id}"
    with transaction(home) as db:  # counted and reserved at once: concurrent uploads cannot pass the quota
        stored = db.execute("select coalesce(sum(bytes), 0) from files where owner = ?", (owner,)).fetchone()[0]
        if stored + size > limits.max_stored_bytes_per_user:
            raise QuotaExceeded(f"your files hold {stored} bytes; {size} more would pass "
                                f"batch.max_stored_bytes_per_user ({limits.max_stored_bytes_per_user}): delete some")
        db.execute("insert into files values (?, ?, ?, ?, ?, ?, ?)",
                   (file.id, owner, file.filename, file.purpose, file.bytes, file.created_at, key))
    try:
        store.put(key, data, retain_days=0)
    except BaseException:
        with transaction(home) as db:
            db.execute("delete from files where id = ?", (file.id,))
        raise
    return file


def delete_file(home: Home, store: ArtifactStore, file_id: str, owner: str) -> None:
    """Forget one of the owner's files and remove its bytes (a batch already made from it keeps its
    requests)."""
    _, key = get_file(home, file_id, owner)
    with transaction(home) as db:
        db.execute("delete from files where id = ?", (file_id,))
    store.delete(key)


def _safe_name(filename: str) -> str:
    """A client's file name, as a name only (no path, no control characters), at most 255 characters."""
    name = filename.replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(char for char in name if char.isprintable() and not 0xD800 <= ord(char) <= 0xDFFF)
    return name[:255] or "upload.jsonl"


def get_file(home: Home, file_id: str, owner: str | None) -> tuple[FileObject, str]:
    """A file and its key in the store; NotFound unless `owner` (None: any) owns it."""
    with connect(home) as db:
        row = db.execute("select * from files where id = ?", (file_id,)).fetchone()
    if row is None or (owner is not None and row["owner"] != owner):
        raise NotFound(f"no file {file_id!r}")
    return FileObject(id=row["id"], bytes=row["bytes"], created_at=row["created_at"], filename=row["filename"],
                      purpose=row["purpose"]), row["key"]


def list_files(home: Home, owner: str) -> list[FileObject]:
    with connect(home) as db:
        rows = db.execute("select * from files where owner = ? order by created_at desc, id", (owner,)).fetchall()
    return [FileObject(id=r["id"], bytes=r["bytes"], created_at=r["created_at"], filename=r["filename"],
                       purpose=r["purpose"]) for r in rows]


# -- batches ------------------------------------------------------------------------------------


def create(home: Home, ask: BatchAsk, who: Owner, limits: BatchSettings) -> Batch:
    """A batch of the requests in the caller's input file, `validating` until the worker has read
    it. Only cheap checks here (the file, the quotas), so creating one never stalls the gateway:
    QuotaExceeded for too many batches not ended, too many validations failed or too many bytes
    validated in the last hour, or no room left for a request."""
    file, _ = get_file(home, ask.input_file_id, who.subject)
    if file.purpose != PURPOSE:
        raise Invalid(f"input_file_id: file {file.id} is not a batch input file")
    now = _now()
    batch_id = new_id("batch_")
    with transaction(home) as db:
        _check_quotas(db, who.subject, limits, now, file.bytes)
        db.execute("insert into batches (id, owner, username, roles, endpoint, input_file_id, completion_window, "
                   "status, created_at, expires_at, metadata, input_bytes, api_key) "
                   "values (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                   (batch_id, who.subject, who.username, json.dumps(sorted(who.roles)), ask.endpoint, file.id,
                    ask.completion_window, BatchState.VALIDATING, now,
                    now + COMPLETION_WINDOWS[ask.completion_window],
                    json.dumps(ask.metadata) if ask.metadata is not None else None, file.bytes, who.key))
        db.execute("insert into batch_validations (batch_id, state) values (?, ?)", (batch_id, RequestState.PENDING))
    return get(home, batch_id, who.subject)


def _check_quotas(db: sqlite3.Connection, subject: str, limits: BatchSettings, now: int, input_bytes: int) -> None:
    active = db.execute("select count(*) from batches where owner = ? and status in "
                        "('validating', 'in_progress', 'cancelling', 'finalizing')", (subject,)).fetchone()[0]
    if active >= limits.max_active_per_user:
        raise QuotaExceeded(f"you have {active} batches validating or in progress (batch.max_active_per_user = "
                            f"{limits.max_active_per_user}); wait for one to end")
    # A validation that did not succeed (failed, or cancelled before it ended) cost the worker a
    # read of the whole file: counted, so that it cannot be repeated at will.
    failed = db.execute("select count(*) from batches where owner = ? and (failed_at > ? or "
                        "(in_progress_at is null and cancelling_at > ?))",
                        (subject, now - QUOTA_WINDOW_S, now - QUOTA_WINDOW_S)).fetchone()[0]
    if failed >= limits.max_failed_validations_per_hour:
        raise QuotaExceeded(f"{failed} of your batches failed validation or were cancelled while validating in "
                            f"the last hour (batch.max_failed_validations_per_hour = "
                            f"{limits.max_failed_validations_per_hour}); check your input files, retry later")
    # Every validation reads its whole file, whatever becomes of the batch (one cancelled as soon
    # as it validated cost as much): the bytes the user had validated in the hour are counted.
    validated = db.execute("select coalesce(sum(input_bytes), 0) from batches where owner = ? and created_at > ?",
                           (subject, now - QUOTA_WINDOW_S)).fetchone()[0]
    if validated + input_bytes > limits.max_validated_bytes_per_hour:
        raise QuotaExceeded(f"your batches created in the last hour have {validated} bytes of input to validate; "
                            f"{input_bytes} more would pass batch.max_validated_bytes_per_hour "
                            f"({limits.max_validated_bytes_per_hour}); retry later")
    pending = _pending(db, subject)
    if pending >= limits.max_pending_requests_per_user:
        raise QuotaExceeded(f"{pending} of your batch requests are waiting (batch.max_pending_requests_per_user "
                            f"= {limits.max_pending_requests_per_user}); wait for some to run")


def _pending(db: sqlite3.Connection, subject: str) -> int:
    """The owner's requests not yet done, over their batches that have requests to run."""
    pending: int = db.execute(
        "select count(*) from batch_requests r join batches b on b.id = r.batch_id where b.owner = ? "
        "and b.status in ('in_progress', 'cancelling', 'finalizing') and r.state != 'done'", (subject,)).fetchone()[0]
    return pending


# -- validation (the worker's side) ---------------------------------------------------------------


@dataclass(frozen=True)
class Validating:
    """A batch whose input file a worker checks and copies into the queue."""

    batch_id: str
    owner: Owner
    endpoint: str
    input_file_id: str
    worker_pid: int


class _Fault(Exception):
    """What is wrong with one line: the field (None: the line itself) and why."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param, self.message = param, message


def claim_validation(home: Home, worker_pid: int, alive: Callable[[int | None], bool]) -> Validating | None:
    """The next batch to validate, claimed for this worker: the oldest validating batch that no
    live worker validates (a validation this worker's pid holds is a dead worker's: it claims only
    between validations), of the user whose last validation ended longest ago (users take turns)."""
    with transaction(home) as db:
        VALIDATIONS.requeue_orphans(db, lambda pid: pid != worker_pid and alive(pid))
        _fail_given_up(db)
        row = db.execute(
            "select b.*, (select max(coalesce(v.in_progress_at, v.failed_at)) from batches v where v.owner = b.owner) "
            "as last from batch_validations q join batches b on b.id = q.batch_id "
            "where q.state = 'pending' and b.status = 'validating' order by coalesce(last, 0), b.created_at, b.rowid "
            "limit 1").fetchone()
        if row is None:
            return None
        VALIDATIONS.take(db, row["id"], worker_pid)
    return Validating(row["id"], _owner(row), row["endpoint"], row["input_file_id"], worker_pid)


def validate(home: Home, store: ArtifactStore, job: Validating, limits: BatchSettings, max_line_bytes: int,
             max_choices: int | None) -> Batch:
    """Read a validating batch's input file as a stream, check it line by line and copy its
    requests into the queue a chunk per transaction; then the batch is in progress, or failed
    naming each bad line (its requests gone). Run again after a crash, it starts over (the rows
    copied before are deleted first). A batch cancelled meanwhile stops it. `max_choices`: the
    owner's max_n (None: no cap). The store unavailable: ArtifactStoreError, the batch stays."""
    with connect(home) as db:
        with immediate(db):
            db.execute("delete from batch_requests where batch_id = ?", (job.batch_id,))
        row = db.execute("select key from files where id = ? and owner = ?",
                         (job.input_file_id, job.owner.subject)).fetchone()
        if row is None:
            _fail(db, job, ErrorEntry(code="invalid_file", param="input_file_id", message=(
                f"the input file {job.input_file_id} was deleted before the batch was validated")))
        else:
            copy = _Copy(db, job, max_line_bytes, max_choices)
            if copy.run(_lines(_chunks(store, row["key"]), max_line_bytes)):
                _conclude(db, job, copy.count, copy.errors, limits)
    return get(home, job.batch_id, None)


def fail_validation(home: Home, job: Validating, code: str, message: str) -> None:
    """End a batch the worker could not validate (not the file's fault) as failed, saying why."""
    with connect(home) as db:
        _fail(db, job, ErrorEntry(code=code, message=message))


def _fail_given_up(db: sqlite3.Connection) -> None:
    """Fail each batch whose validation was given up (its workers died on it too often); only the
    bound on retries ends a validation while its batch still validates."""
    given_up = db.execute("select q.batch_id from batch_validations q join batches b on b.id = q.batch_id "
                          "where q.state = 'done' and b.status = 'validating'").fetchall()
    error = ErrorEntry(code="validation_failed", message=(
        f"the batch worker stopped {MAX_VALIDATION_ATTEMPTS} times while checking this input file; "
        "it is not tried again (ask an administrator to look at the batch worker's log)"))
    for (batch_id,) in given_up:
        db.execute("delete from batch_requests where batch_id = ?", (batch_id,))
        db.execute("update batches set errors = ?, total = 0 where id = ?",
                   (Errors(data=[error]).model_dump_json(), batch_id))
        _move(db, batch_id, BatchState.FAILED)


def _fail(db: sqlite3.Connection, job: Validating, error: ErrorEntry) -> None:
    with immediate(db):
        if _still_mine(db, job):
            _end(db, job, 0, [error])


class _Copy:
    """An input file's lines checked, their requests copied into the queue in chunks; a custom_id
    maybe seen before (by a fixed-size filter) is looked up in the queue: memory stays bounded."""

    def __init__(self, db: sqlite3.Connection, job: Validating, max_line_bytes: int, max_choices: int | None):
        self.db, self.job, self.max_line_bytes, self.max_choices = db, job, max_line_bytes, max_choices
        self.count = 0  # requests found, each numbered in the queue in file order
        self.errors: list[ErrorEntry] = []
        self.chunk: dict[str, str] = {}  # custom_id -> body (JSON, as sent) not yet copied
        self.chunk_bytes = 0
        self.filter = bytearray(SEEN_BITS // 8)

    def run(self, lines: Iterable[tuple[int, bytes | None]]) -> bool:
        """Every line checked and its request copied; False if the batch stopped being this
        worker's to validate (cancelled)."""
        for number, raw in lines:
            try:
                self._line(raw)
            except _Fault as fault:
                if len(self.errors) < MAX_ERRORS:
                    self.errors.append(ErrorEntry(code="invalid_request", message=fault.message, param=fault.param,
                                                  line=number))
            if (len(self.chunk) >= CHUNK_ROWS or self.chunk_bytes >= CHUNK_BYTES) and not self._flush():
                return False
        return self._flush()

    def _line(self, raw: bytes | None) -> None:
        if raw is None:
            raise _Fault(None, f"the line is longer than {self.max_line_bytes} bytes (gateway.max_body_bytes)")
        if not raw.strip():
            return
        custom_id, wire = _check_line(raw, self.job.endpoint, self.max_line_bytes, self.max_choices, self._seen)
        self.chunk[custom_id] = wire.decode("ascii")
        self.chunk_bytes += len(wire)

    def _seen(self, custom_id: str) -> bool:
        bits = [hash(custom_id) % SEEN_BITS, hash(custom_id[::-1]) % SEEN_BITS]
        if all(self.filter[bit >> 3] & (1 << (bit & 7)) for bit in bits):
            return custom_id in self.chunk or self.db.execute(
                "select 1 from batch_requests where batch_id = ? and custom_id = ?",
                (self.job.batch_id, custom_id)).fetchone() is not None
        for bit in bits:
            self.filter[bit >> 3] |= 1 << (bit & 7)
        return False

    def _flush(self) -> bool:
        with immediate(self.db):
            if not _still_mine(self.db, self.job):
                return False
            first = self.count + 1
            self.db.executemany("insert into batch_requests (batch_id, line, custom_id, body, state) "
                                "values (?, ?, ?, ?, 'pending')",
                                [(self.job.batch_id, line, custom_id, body)
                                 for line, (custom_id, body) in enumerate(self.chunk.items(), first)])
        self.count += len(self.chunk)
        self.chunk.clear()
        self.chunk_bytes = 0
        return True


def _still_mine(db: sqlite3.Connection, job: Validating) -> bool:
    """Whether the batch is still validating under this worker; if not, cancelled meanwhile, the
    requests copied so far go (in the caller's transaction)."""
    row = db.execute("select b.status, q.state, q.worker_pid from batches b join batch_validations q "
                     "on q.batch_id = b.id where b.id = ?", (job.batch_id,)).fetchone()
    if row is not None and row["status"] == BatchState.VALIDATING and row["state"] == RequestState.CLAIMED \
            and row["worker_pid"] == job.worker_pid:
        return True
    if row is not None and row["status"] != BatchState.VALIDATING:
        db.execute("delete from batch_requests where batch_id = ?", (job.batch_id,))
        VALIDATIONS.finish(db, job.batch_id, RequestState.DONE)
    return False


def _conclude(db: sqlite3.Connection, job: Validating, count: int, errors: list[ErrorEntry],
              limits: BatchSettings) -> None:
    """In progress with its `count` requests, or failed with `errors` (the lines', then the
    batch's own: too many requests, none, no room left for them) and none."""
    with immediate(db):
        if not _still_mine(db, job):
            return
        if count > limits.max_requests:
            errors.insert(0, ErrorEntry(code="too_many_requests", message=f"{count} requests; a batch may hold "
                                        f"{limits.max_requests} (batch.max_requests)"))
        elif not count and not errors:
            errors.append(ErrorEntry(code="empty_file", message="the input file holds no requests"))
        elif not errors and (pending := _pending(db, job.owner.subject)) + count > \
                limits.max_pending_requests_per_user:
            errors.append(ErrorEntry(code="too_many_pending_requests", message=(
                f"{pending} of your batch requests are waiting; {count} more would pass "
                f"batch.max_pending_requests_per_user ({limits.max_pending_requests_per_user})")))
        _end(db, job, count, errors)


def _end(db: sqlite3.Connection, job: Validating, count: int, errors: list[ErrorEntry]) -> None:
    if errors:
        db.execute("delete from batch_requests where batch_id = ?", (job.batch_id,))
    db.execute("update batches set errors = ?, total = ? where id = ?",
               (Errors(data=errors).model_dump_json() if errors else None, 0 if errors else count, job.batch_id))
    VALIDATIONS.finish(db, job.batch_id, RequestState.DONE, holder=job.worker_pid)
    _move(db, job.batch_id, BatchState.FAILED if errors else BatchState.IN_PROGRESS)


def _check_line(raw: bytes, endpoint: str, max_line_bytes: int, max_choices: int | None,
               seen: Callable[[str], bool]) -> tuple[str, bytes]:
    """One line's request (custom_id, body as the worker sends it); _Fault naming the field if it is bad. A line must be
    what the worker can send as it is: strict JSON (no NaN), no lone surrogates, at most
    `max_line_bytes` (the gateway's body limit) as sent, at most `max_choices` choices, with a
    custom_id not `seen` before."""
    try:
        item = json.loads(raw, parse_constant=_no_constant)
        json.dumps(item, ensure_ascii=False, allow_nan=False).encode()  # no lone surrogate, no 1e999
    except (ValueError, UnicodeError) as exc:
        raise _Fault(None, _json_fault(exc)) from None
    except RecursionError:
        raise _Fault(None, "nested too deeply") from None
    if not isinstance(item, dict):
        raise _Fault(None, "a line must be a JSON object")
    if unknown := sorted(set(item) - {"custom_id", "method", "url", "body"}):
        raise _Fault(unknown[0][:64], f"unknown field {unknown[0][:64]!r}")
    custom_id, body = item.get("custom_id"), item.get("body")
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= CUSTOM_ID_MAX:
        raise _Fault("custom_id", f"custom_id must be a string of 1 to {CUSTOM_ID_MAX} characters")
    if seen(custom_id):
        raise _Fault("custom_id", "custom_id is not unique in the file")
    if item.get("method") != "POST":
        raise _Fault("method", "method must be 'POST'")
    if item.get("url") != endpoint:
        raise _Fault("url", f"url must be the batch's endpoint, {endpoint}")
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        raise _Fault("body", "body must be an object naming a model")
    if body.get("stream"):
        raise _Fault("body.stream", "a batch request cannot be streamed")
    if len(wire := wire_body(body)) > max_line_bytes:  # as the worker sends it
        raise _Fault("body", f"the body is longer than {max_line_bytes} bytes once encoded as the gateway gets it "
                     "(gateway.max_body_bytes)")
    _check_choices(body, max_choices)
    return custom_id, wire


def _check_choices(body: dict[str, Any], max_choices: int | None) -> None:
    """The engine produces prompts x n choices for a body; the owner's max_n caps them (as the
    gateway does when the request is sent, and as it does, `best_of` is refused)."""
    if "best_of" in body:
        raise _Fault("body.best_of", "best_of is not supported (the engine has none; ask for n choices)")
    n = body.get("n", 1)
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise _Fault("body.n", "n must be a positive integer")
    prompts = prompt_count(body.get("prompt"))
    choices = prompts * (n or 1)
    if max_choices is not None and choices > max_choices:
        raise _Fault("body.prompt" if prompts > 1 else "body.n",
                     f"{choices} choices asked ({prompts} prompts x n {n or 1}); your role allows {max_choices} "
                     "(gateway.limits max_n)")


def _lines(chunks: Iterable[bytes], max_line_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """The lines of a file read in chunks, numbered from 1; only "\\n" ends one (JSON text may hold
    U+2028). A line longer than `max_line_bytes` is None, and is not kept in memory."""
    number, part, too_long = 1, bytearray(), False
    for chunk in chunks:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            piece = chunk[start:end]
            yield number, None if too_long or len(part) + len(piece) > max_line_bytes else bytes(part + piece)
            number, part, too_long, start = number + 1, bytearray(), False, end + 1
        rest = chunk[start:]
        too_long = too_long or len(part) + len(rest) > max_line_bytes
        part = bytearray() if too_long else part + rest
    if part or too_long:
        yield number, None if too_long else bytes(part)


def _chunks(store: ArtifactStore, key: str) -> Iterator[bytes]:
    """A stored file READ_BYTES at a time (ranged reads on S3; a store without them: at once)."""
    if isinstance(store, LocalStore):
        path = store.root / key
        try:
            with path.open("rb") as file:
                while chunk := file.read(READ_BYTES):
                    yield chunk
        except OSError as exc:
            raise ArtifactStoreError(f"cannot read {path}: {exc.strerror or exc}") from exc
    elif isinstance(store, S3Store):
        size, _ = store.size_and_etag(key)
        for offset in range(0, size, READ_BYTES):
            yield store.get(key, offset, min(READ_BYTES, size - offset))
    else:
        yield store.get(key)


def wire_body(body: dict[str, Any]) -> bytes:
    """A request's body as the batch-worker sends it to the gateway."""
    return json.dumps(body, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _json_fault(exc: ValueError | UnicodeError) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"not JSON ({exc.msg} at column {exc.colno})"
    if isinstance(exc, UnicodeError):
        return "not UTF-8, or a lone surrogate"
    return f"not JSON ({exc})"


def _batch(row: sqlite3.Row) -> Batch:
    fields = {name: row[name] for name in Batch.model_fields if name in row.keys()}
    return Batch(**{**fields, "errors": json.loads(row["errors"]) if row["errors"] else None,
                    "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
                    "request_counts": RequestCounts(total=row["total"], completed=row["completed"],
                                                    failed=row["failed"])})


def get(home: Home, batch_id: str, owner: str | None) -> Batch:
    """A batch; NotFound unless `owner` (None: any) created it."""
    with connect(home) as db:
        row = db.execute("select * from batches where id = ?", (batch_id,)).fetchone()
    if row is None or (owner is not None and row["owner"] != owner):
        raise NotFound(f"no batch {batch_id!r}")
    return _batch(row)


def listing(home: Home, owner: str | None, *, after: str | None = None, limit: int = 20) -> list[Batch]:
    """Batches newest first (the caller's, or everyone's for None), from after the one named `after`."""
    with connect(home) as db:
        rows = db.execute(
            "select * from batches where (? is null or owner = ?) and (? is null or (created_at, id) < "
            "(select created_at, id from batches where id = ?)) order by created_at desc, id desc limit ?",
            (owner, owner, after, after, limit)).fetchall()
    return [_batch(row) for row in rows]


def owner_of(home: Home, batch_id: str) -> tuple[Owner, str]:
    """Who a batch runs for, and its state."""
    with connect(home) as db:
        row = db.execute("select owner, username, roles, api_key, status from batches where id = ?",
                         (batch_id,)).fetchone()
    if row is None:
        raise NotFound(f"no batch {batch_id!r}")
    return _owner(row), row["status"]


def _owner(row: sqlite3.Row) -> Owner:
    return Owner(row["owner"], row["username"], frozenset(json.loads(row["roles"])), row["api_key"])


def _move(db: sqlite3.Connection, batch_id: str, to: BatchState) -> None:
    row = db.execute("select status from batches where id = ?", (batch_id,)).fetchone()
    if row is None:
        raise NotFound(f"no batch {batch_id!r}")
    BATCH_LIFECYCLE.check(batch_id, BatchState(row["status"]), to)
    db.execute(f"update batches set status = ?, {STAMPS[to]} = ? where id = ?", (to, _now(), batch_id))


def cancel(home: Home, batch_id: str, owner: str | None) -> Batch:
    """Stop a batch: no further request starts; those running finish, then it ends cancelled with
    the answers it has. Conflict for one that has ended."""
    get(home, batch_id, owner)
    with transaction(home) as db:
        status = BatchState(db.execute("select status from batches where id = ?", (batch_id,)).fetchone()[0])
        if status in ENDED or status == BatchState.FINALIZING:
            raise Conflict(f"batch {batch_id} is {status}; only a batch validating or in progress can be cancelled")
        if status in (BatchState.VALIDATING, BatchState.IN_PROGRESS):
            _stop(db, batch_id, status)
    return get(home, batch_id, owner)


def cancel_all_of(home: Home, subject: str) -> int:
    """Cancel every batch validating or in progress of a user (disabled: their requests stop)."""
    with transaction(home) as db:
        rows = db.execute("select id, status from batches where owner = ? and status in "
                          "('validating', 'in_progress')", (subject,)).fetchall()
        for batch_id, status in rows:
            _stop(db, batch_id, BatchState(status))
    return len(rows)


def _stop(db: sqlite3.Connection, batch_id: str, status: BatchState) -> None:
    """Cancelling, and a validation not begun is not begun (one under way stops at its next chunk)."""
    _move(db, batch_id, BatchState.CANCELLING)
    if status == BatchState.VALIDATING:  # (a row first: one made by a process older than this one's migration)
        db.execute("insert or ignore into batch_validations (batch_id, state) values (?, ?)",
                   (batch_id, RequestState.PENDING))
        VALIDATIONS.finish(db, batch_id, RequestState.DONE)


# -- the worker's side ---------------------------------------------------------------------------


def claim(home: Home, worker_pid: int, alive: Alive, limit: int) -> list[Claimed]:
    """Up to `limit` pending requests of batches in progress, claimed for this worker, taken from
    the users in turn (one user's big batch does not hold the others' back) and not before a
    request's retry time. First, requests claimed by workers no longer alive are pending again, and
    so are this worker's own (it claims only once its earlier requests are done: those are a dead
    worker's whose pid it was given)."""
    now = _now()
    with transaction(home) as db:
        given_up: list[Key] = []
        REQUESTS.requeue_orphans(db, lambda pid: pid != worker_pid and alive(pid), given_up)
        for key in given_up:
            db.execute("update batches set failed = failed + 1 where id = (select batch_id from batch_requests "
                       "where rowid = ?)", (key,))
        rows = db.execute(
            "select * from (select r.rowid as key, r.batch_id, r.line, r.custom_id, r.body, r.attempts, b.endpoint, "
            "b.created_at, "
            "row_number() over (partition by b.owner order by b.created_at, r.batch_id, r.line) as turn "
            "from batch_requests r join batches b on b.id = r.batch_id where r.state = 'pending' "
            "and b.status = 'in_progress' and b.expires_at > ? and (r.retry_at is null or r.retry_at <= ?)) "
            "order by turn, created_at limit ?", (now, now, limit)).fetchall()
        for row in rows:
            REQUESTS.take(db, row["key"], worker_pid)
    return [Claimed(row["batch_id"], row["line"], row["custom_id"], row["endpoint"], json.loads(row["body"]),
                    row["attempts"]) for row in rows]


def is_claimed(home: Home, batch_id: str, line: int) -> bool:
    """Whether a request is claimed by a worker now (the gateway runs no other as a batch request)."""
    with connect(home) as db:
        row = db.execute("select r.state, b.status from batch_requests r join batches b on b.id = r.batch_id "
                         "where r.batch_id = ? and r.line = ?", (batch_id, line)).fetchone()
    return row is not None and row["state"] == "claimed" and row["status"] in ("in_progress", "cancelling")


def release(home: Home, request: Claimed, retry_in_s: float, *, failed: bool = False) -> None:
    """Give a claimed request back, not to be claimed again for `retry_in_s` (the gateway asked to
    retry later: its owner's budget is spent, or its engine is down or failed); other requests go
    on. `failed`: it failed in a way that may pass, and counts as an attempt."""
    with transaction(home) as db:
        key = _request_key(db, request)
        if key is not None and REQUESTS.release(db, key, None, retry_at=_now() + math.ceil(retry_in_s)):
            # Given back alive: its claim is not a death; a failure that may pass is an attempt.
            db.execute("update batch_requests set claims = max(claims - 1, 0), attempts = attempts + ? "
                       "where rowid = ?", (int(failed), key))


def finish(home: Home, request: Claimed, status_code: int, request_id: str | None, response: object) -> None:
    """Record a request's answer, once, while its batch runs (a second worker's answer to a request
    run twice, or an answer arriving after its batch ended, is dropped)."""
    with transaction(home) as db:
        running = db.execute("select 1 from batches where id = ? and status in ('in_progress', 'cancelling')",
                             (request.batch_id,)).fetchone()
        key = _request_key(db, request)
        if running and key is not None and REQUESTS.finish(
                db, key, RequestState.DONE, status_code=status_code, request_id=request_id,
                response=json.dumps(response)):
            column = "completed" if status_code == 200 else "failed"
            db.execute(f"update batches set {column} = {column} + 1 where id = ?", (request.batch_id,))


def fail_remaining(home: Home, batch_id: str, status_code: int, response: object) -> int:
    """Fail every request of a running batch not yet sent, with one answer (its owner can no longer
    run it: the role lost, the key revoked); how many. Those being sent get their own answers."""
    with transaction(home) as db:
        if not db.execute("select 1 from batches where id = ? and status in ('in_progress', 'cancelling')",
                          (batch_id,)).fetchone():
            return 0
        keys = [row[0] for row in db.execute("select rowid from batch_requests where batch_id = ? and state = ?",
                                             (batch_id, RequestState.PENDING))]
        for key in keys:
            REQUESTS.finish(db, key, RequestState.DONE, status_code=status_code, response=json.dumps(response))
        db.execute("update batches set failed = failed + ? where id = ?", (len(keys), batch_id))
    return len(keys)


def _request_key(db: sqlite3.Connection, request: Claimed) -> Key | None:
    """A request's key in the queue (None: it is gone)."""
    row = db.execute("select rowid from batch_requests where batch_id = ? and line = ?",
                     (request.batch_id, request.line)).fetchone()
    return None if row is None else int(row[0])


def to_finalize(home: Home) -> list[str]:
    """Batches ready to end (none of their requests running): in progress with every request done
    or past their window; cancelling; left finalizing by a worker that died."""
    with connect(home) as db:
        rows = db.execute(
            "select id from batches b where status = 'finalizing' "
            "or (status in ('in_progress', 'cancelling') and not exists (select 1 from batch_requests r "
            "where r.batch_id = b.id and r.state = 'claimed') and (status = 'cancelling' or expires_at <= ? "
            "or not exists (select 1 from batch_requests r where r.batch_id = b.id and r.state != 'done'))) "
            "order by created_at", (_now(),)).fetchall()
    return [row[0] for row in rows]


def finalize(home: Home, store: ArtifactStore, batch_id: str) -> Batch:
    """Write a batch's output and error files (one line per request done, in input order; an
    expired batch's unrun requests in the error file) and end it. Run again after a crash, it
    writes the same files under the same ids. The prompts and answers then leave the queue: the
    output file holds them, and its owner may delete it."""
    with transaction(home) as db:
        row = db.execute("select * from batches where id = ?", (batch_id,)).fetchone()
        if BatchState(row["status"]) != BatchState.FINALIZING:
            _move(db, batch_id, BatchState.FINALIZING)
        requests = db.execute("select * from batch_requests where batch_id = ? order by line", (batch_id,)).fetchall()
    unrun = sum(1 for request in requests if request["state"] != "done")
    if row["cancelling_at"] is not None:
        ending = BatchState.CANCELLED
    else:
        ending = BatchState.EXPIRED if unrun else BatchState.COMPLETED
    output: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    for request in requests:
        if request["state"] != "done":
            if ending == BatchState.EXPIRED:
                failures.append(_line(request, None, {"code": "batch_expired", "message": "This request could not "
                                      "be executed before the completion window expired."}))
            continue
        answer = {"status_code": request["status_code"], "request_id": request["request_id"],
                  "body": json.loads(request["response"])}
        (output if request["status_code"] == 200 else failures).append(_line(request, answer, None))
    ids = {}
    for kind, lines in (("output", output), ("error", failures)):
        if lines:
            data = "".join(json.dumps(line) + "\n" for line in lines).encode()
            key = f"batches/{batch_id}/{kind}.jsonl"
            store.put(key, data, retain_days=0)
            ids[kind] = f"file-{batch_id.removeprefix('batch_')}-{kind}"
            with transaction(home) as db:
                db.execute("insert or replace into files values (?, ?, ?, ?, ?, ?, ?)",
                           (ids[kind], row["owner"], f"{batch_id}_{kind}.jsonl", "batch_output", len(data), _now(),
                            key))
    with transaction(home) as db:
        db.execute("update batches set output_file_id = ?, error_file_id = ?, failed = failed + ? where id = ?",
                   (ids.get("output"), ids.get("error"), unrun if ending == BatchState.EXPIRED else 0, batch_id))
        _move(db, batch_id, ending)
        db.execute("update batch_requests set body = '{}', response = null where batch_id = ?", (batch_id,))
    return get(home, batch_id, None)


def to_announce(home: Home) -> list[Batch]:
    """Ended batches whose end is not yet in the audit log."""
    with connect(home) as db:
        rows = db.execute("select * from batches where announced = 0 and status in ('failed', 'completed', "
                          "'expired', 'cancelled') order by created_at").fetchall()
    return [_batch(row) for row in rows]


def announced(home: Home, batch_id: str) -> None:
    with transaction(home) as db:
        db.execute("update batches set announced = 1 where id = ?", (batch_id,))


def _line(request: sqlite3.Row, response: dict[str, Any] | None, error: dict[str, str] | None) -> dict[str, Any]:
    return {"id": f"batch_req_{request['batch_id'].removeprefix('batch_')}_{request['line']}",
            "custom_id": request["custom_id"], "response": response, "error": error}
