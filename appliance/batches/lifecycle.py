"""A batch made, read and cancelled: creating one checks only what is cheap (the file, the owner's
quotas) and leaves it validating; every move is checked against the batch's lifecycle inside the
transaction making it."""

from __future__ import annotations

import json
import sqlite3

from appliance.batches.files import PURPOSE, get_file
from appliance.batches.records import (
    BATCH_LIFECYCLE,
    ENDED,
    STAMPS,
    Batch,
    BatchAsk,
    BatchState,
    Owner,
    RequestCounts,
)
from appliance.batches.store import VALIDATIONS, RequestState, connect, new_id, transaction, unix_time
from appliance.errors import Conflict, Invalid, NotFound, QuotaExceeded
from appliance.home import Home
from appliance.settings import BatchSettings

COMPLETION_WINDOWS = {"24h": 24 * 3600}
QUOTA_WINDOW_S = 3600  # batch.max_failed_validations_per_hour and max_validated_bytes_per_hour count over this


def create(home: Home, ask: BatchAsk, who: Owner, limits: BatchSettings) -> Batch:
    """A batch of the requests in the caller's input file, `validating` until the worker has read
    it. Only cheap checks here (the file, the quotas), so creating one never stalls the gateway:
    QuotaExceeded for too many batches not ended, too many validations failed or too many bytes
    validated in the last hour, or no room left for a request."""
    file, _ = get_file(home, ask.input_file_id, who.subject)
    if file.purpose != PURPOSE:
        raise Invalid(f"input_file_id: file {file.id} is not a batch input file")
    now = unix_time()
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
    pending = pending_requests(db, subject)
    if pending >= limits.max_pending_requests_per_user:
        raise QuotaExceeded(f"{pending} of your batch requests are waiting (batch.max_pending_requests_per_user "
                            f"= {limits.max_pending_requests_per_user}); wait for some to run")


def pending_requests(db: sqlite3.Connection, subject: str) -> int:
    """The owner's requests not yet done, over their batches that have requests to run."""
    pending: int = db.execute(
        "select count(*) from batch_requests r join batches b on b.id = r.batch_id where b.owner = ? "
        "and b.status in ('in_progress', 'cancelling', 'finalizing') and r.state != 'done'", (subject,)).fetchone()[0]
    return pending


def batch_from_row(row: sqlite3.Row) -> Batch:
    """A row of the batches table as OpenAI's batch object."""
    fields = {name: row[name] for name in Batch.model_fields if name in row.keys()}
    return Batch(**{**fields, "errors": json.loads(row["errors"]) if row["errors"] else None,
                    "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
                    "owner": row["username"],  # the row's owner is the token subject: an id, not a name
                    "request_counts": RequestCounts(total=row["total"], completed=row["completed"],
                                                    failed=row["failed"])})


def get(home: Home, batch_id: str, owner: str | None) -> Batch:
    """A batch; NotFound unless `owner` (None: any) created it."""
    with connect(home) as db:
        row = db.execute("select * from batches where id = ?", (batch_id,)).fetchone()
    if row is None or (owner is not None and row["owner"] != owner):
        raise NotFound(f"no batch {batch_id!r}")
    return batch_from_row(row)


def listing(home: Home, owner: str | None, *, after: str | None = None, limit: int = 20) -> list[Batch]:
    """Batches newest first (the caller's, or everyone's for None), from after the one named `after`."""
    with connect(home) as db:
        rows = db.execute(
            "select * from batches where (? is null or owner = ?) and (? is null or (created_at, id) < "
            "(select created_at, id from batches where id = ?)) order by created_at desc, id desc limit ?",
            (owner, owner, after, after, limit)).fetchall()
    return [batch_from_row(row) for row in rows]


def owner_of(home: Home, batch_id: str) -> tuple[Owner, str]:
    """Who a batch runs for, and its state."""
    with connect(home) as db:
        row = db.execute("select owner, username, roles, api_key, status from batches where id = ?",
                         (batch_id,)).fetchone()
    if row is None:
        raise NotFound(f"no batch {batch_id!r}")
    return owner_from_row(row), row["status"]


def owner_from_row(row: sqlite3.Row) -> Owner:
    """Whom a row of the batches table runs for."""
    return Owner(row["owner"], row["username"], frozenset(json.loads(row["roles"])), row["api_key"])


def move(db: sqlite3.Connection, batch_id: str, to: BatchState) -> None:
    """Move a batch to `to` and stamp the time (in the caller's transaction); NotFound for no such
    batch, IllegalTransition for a move its lifecycle does not allow."""
    row = db.execute("select status from batches where id = ?", (batch_id,)).fetchone()
    if row is None:
        raise NotFound(f"no batch {batch_id!r}")
    BATCH_LIFECYCLE.check(batch_id, BatchState(row["status"]), to)
    db.execute(f"update batches set status = ?, {STAMPS[to]} = ? where id = ?", (to, unix_time(), batch_id))


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
    move(db, batch_id, BatchState.CANCELLING)
    if status == BatchState.VALIDATING:  # (a row first: one made by a process older than this one's migration)
        db.execute("insert or ignore into batch_validations (batch_id, state) values (?, ?)",
                   (batch_id, RequestState.PENDING))
        VALIDATIONS.finish(db, batch_id, RequestState.DONE)
