"""Validation, the worker's side: a validating batch claimed, its input file read as a stream, each
line checked and its request copied into the queue a chunk per transaction; then the batch is in
progress, or failed naming each bad line. How the file is read and how many rows a chunk holds are
parameters of `validate` (the worker keeps the defaults)."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from appliance.artifacts import ArtifactStore
from appliance.batches.lifecycle import get, move, owner_from_row, pending_requests
from appliance.batches.lines import LineFault, Reader, check_line, read_chunks, split_lines
from appliance.batches.records import Batch, BatchState, ErrorEntry, Errors, Owner
from appliance.batches.store import MAX_VALIDATION_ATTEMPTS, VALIDATIONS, RequestState, connect, transaction
from appliance.home import Home
from appliance.queue import immediate
from appliance.settings import BatchSettings

MAX_ERRORS = 100  # of an input file's faults, the first this many are named
CHUNK_ROWS, CHUNK_BYTES = 1000, 4 << 20  # requests copied into the queue per transaction, at most
SEEN_BITS = 1 << 23  # a filter of the custom_ids seen (1 MiB): most are new, and need no look-up


@dataclass(frozen=True)
class Validating:
    """A batch whose input file a worker checks and copies into the queue."""

    batch_id: str
    owner: Owner
    endpoint: str
    input_file_id: str
    worker_pid: int


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
    return Validating(row["id"], owner_from_row(row), row["endpoint"], row["input_file_id"], worker_pid)


def validate(home: Home, store: ArtifactStore, job: Validating, limits: BatchSettings, max_line_bytes: int,
             max_choices: int | None, *, read: Reader = read_chunks, chunk_rows: int = CHUNK_ROWS) -> Batch:
    """Read a validating batch's input file as a stream, check it line by line and copy its
    requests into the queue a chunk per transaction; then the batch is in progress, or failed
    naming each bad line (its requests gone). Run again after a crash, it starts over (the rows
    copied before are deleted first). A batch cancelled meanwhile stops it. `max_choices`: the
    owner's max_n (None: no cap). The store unavailable: ArtifactStoreError, the batch stays.
    `read` reads the file from the store, `chunk_rows` requests at most are copied per transaction
    (tests read in small pieces, fail or cancel mid-file through them)."""
    with connect(home) as db:
        with immediate(db):
            db.execute("delete from batch_requests where batch_id = ?", (job.batch_id,))
        row = db.execute("select key from files where id = ? and owner = ?",
                         (job.input_file_id, job.owner.subject)).fetchone()
        if row is None:
            _fail(db, job, ErrorEntry(code="invalid_file", param="input_file_id", message=(
                f"the input file {job.input_file_id} was deleted before the batch was validated")))
        else:
            copy = _Copy(db, job, max_line_bytes, max_choices, chunk_rows)
            if copy.run(split_lines(read(store, row["key"]), max_line_bytes)):
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
        move(db, batch_id, BatchState.FAILED)


def _fail(db: sqlite3.Connection, job: Validating, error: ErrorEntry) -> None:
    with immediate(db):
        if _still_mine(db, job):
            _end(db, job, 0, [error])


class _Copy:
    """An input file's lines checked, their requests copied into the queue in chunks; a custom_id
    maybe seen before (by a fixed-size filter) is looked up in the queue: memory stays bounded."""

    def __init__(self, db: sqlite3.Connection, job: Validating, max_line_bytes: int, max_choices: int | None,
                 chunk_rows: int) -> None:
        self.db, self.job, self.max_line_bytes, self.max_choices = db, job, max_line_bytes, max_choices
        self.chunk_rows = chunk_rows
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
            except LineFault as fault:
                if len(self.errors) < MAX_ERRORS:
                    self.errors.append(ErrorEntry(code="invalid_request", message=fault.message, param=fault.param,
                                                  line=number))
            if (len(self.chunk) >= self.chunk_rows or self.chunk_bytes >= CHUNK_BYTES) and not self._flush():
                return False
        return self._flush()

    def _line(self, raw: bytes | None) -> None:
        if raw is None:
            raise LineFault(None, f"the line is longer than {self.max_line_bytes} bytes (gateway.max_body_bytes)")
        if not raw.strip():
            return
        custom_id, wire = check_line(raw, self.job.endpoint, self.max_line_bytes, self.max_choices, self._seen)
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
        elif not errors and (pending := pending_requests(db, job.owner.subject)) + count > \
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
    move(db, job.batch_id, BatchState.FAILED if errors else BatchState.IN_PROGRESS)
