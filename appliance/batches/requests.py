"""A batch's requests, the worker's side: claimed in turns across users, given back to retry later,
answered once, or failed together when their owner can no longer run them."""

from __future__ import annotations

import json
import math
import sqlite3

from appliance.batches.records import Claimed
from appliance.batches.store import REQUESTS, RequestState, connect, transaction, unix_time
from appliance.home import Home
from appliance.queue import Alive, Key

# The batch worker sends each request to the gateway with this header ("<batch id>:<line>") and the
# key kept under this secret's name: the gateway runs it as the batch's owner.
BATCH_HEADER = "x-appliance-batch-request"
BATCH_WORKER_SECRET = "batch-worker-key"


def claim(home: Home, worker_pid: int, alive: Alive, limit: int) -> list[Claimed]:
    """Up to `limit` pending requests of batches in progress, claimed for this worker, taken from
    the users in turn (one user's big batch does not hold the others' back) and not before a
    request's retry time. First, requests claimed by workers no longer alive are pending again, and
    so are this worker's own (it claims only once its earlier requests are done: those are a dead
    worker's whose pid it was given)."""
    now = unix_time()
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
        if key is not None and REQUESTS.release(db, key, None, retry_at=unix_time() + math.ceil(retry_in_s)):
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
