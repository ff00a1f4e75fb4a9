"""A batch's end: its output and error files written (one line per request, in input order) and its
final state set; then its end announced to the audit log."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from appliance.artifacts import ArtifactStore
from appliance.batches.lifecycle import batch_from_row, get, move
from appliance.batches.records import Batch, BatchState
from appliance.batches.store import connect, transaction, unix_time
from appliance.home import Home


def to_finalize(home: Home) -> list[str]:
    """Batches ready to end (none of their requests running): in progress with every request done
    or past their window; cancelling; left finalizing by a worker that died."""
    with connect(home) as db:
        rows = db.execute(
            "select id from batches b where status = 'finalizing' "
            "or (status in ('in_progress', 'cancelling') and not exists (select 1 from batch_requests r "
            "where r.batch_id = b.id and r.state = 'claimed') and (status = 'cancelling' or expires_at <= ? "
            "or not exists (select 1 from batch_requests r where r.batch_id = b.id and r.state != 'done'))) "
            "order by created_at", (unix_time(),)).fetchall()
    return [row[0] for row in rows]


def finalize(home: Home, store: ArtifactStore, batch_id: str) -> Batch:
    """Write a batch's output and error files (one line per request done, in input order; an
    expired batch's unrun requests in the error file) and end it. Run again after a crash, it
    writes the same files under the same ids. The prompts and answers then leave the queue: the
    output file holds them, and its owner may delete it."""
    with transaction(home) as db:
        row = db.execute("select * from batches where id = ?", (batch_id,)).fetchone()
        if BatchState(row["status"]) != BatchState.FINALIZING:
            move(db, batch_id, BatchState.FINALIZING)
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
                           (ids[kind], row["owner"], f"{batch_id}_{kind}.jsonl", "batch_output", len(data), unix_time(),
                            key))
    with transaction(home) as db:
        db.execute("update batches set output_file_id = ?, error_file_id = ?, failed = failed + ? where id = ?",
                   (ids.get("output"), ids.get("error"), unrun if ending == BatchState.EXPIRED else 0, batch_id))
        move(db, batch_id, ending)
        db.execute("update batch_requests set body = '{}', response = null where batch_id = ?", (batch_id,))
    return get(home, batch_id, None)


def to_announce(home: Home) -> list[Batch]:
    """Ended batches whose end is not yet in the audit log."""
    with connect(home) as db:
        rows = db.execute("select * from batches where announced = 0 and status in ('failed', 'completed', "
                          "'expired', 'cancelled') order by created_at").fetchall()
    return [batch_from_row(row) for row in rows]


def announced(home: Home, batch_id: str) -> None:
    with transaction(home) as db:
        db.execute("update batches set announced = 1 where id = ?", (batch_id,))


def _line(request: sqlite3.Row, response: dict[str, Any] | None, error: dict[str, str] | None) -> dict[str, Any]:
    return {"id": f"batch_req_{request['batch_id'].removeprefix('batch_')}_{request['line']}",
            "custom_id": request["custom_id"], "response": response, "error": error}
