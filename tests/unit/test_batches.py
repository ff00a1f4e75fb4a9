"""The batch queue's rules (appliance.batches): input files checked line by line by the
worker (streamed, in chunks, starting over after a crash), quotas, claims that outlive a dead
worker, cancel, expiry, and output files in input order."""

from __future__ import annotations

import json
import sqlite3
import tempfile
from pathlib import Path

import httpx
import pytest

from appliance import batches, durable
from appliance.artifacts import LocalStore
from appliance.batches import BatchState
from appliance.errors import Conflict, Invalid, NotFound, QuotaExceeded
from appliance.home import Home
from appliance.queue import immediate
from appliance.settings import BatchSettings, Settings
from serve import batch_worker
from tests.support.batches import ANN, BOB, CHAT, create, create_only, line, upload


def test_a_bad_input_file_fails_its_batch_naming_each_bad_line(home: Home, store: LocalStore) -> None:
    lines = [line("a"), "{not json", line("a"), line("b", url="/v1/completions"), line("c", method="GET"),
             json.dumps({"custom_id": "d", "method": "POST", "url": CHAT, "body": {"messages": []}}),
             line("e", extra=1), line("f", body={"model": "m", "stream": True}), "[1]",
             line("g", body={"model": "m", "temperature": float("nan")}),  # NaN: not JSON, the worker could not send it
             line("h\ud800"), "[" * 100_000 + "]" * 100_000, line("i" * 600),
             line("j", body={"model": "x" * 2_000_000}),
             json.dumps({"custom_id": "k\u2028still one line", "method": "POST", "url": CHAT, "body": {"model": "m"}}),
             line("l").replace('"model": "m"', '"model": "m", "temperature": 1e999'),
             json.dumps({"custom_id": "m", "method": "POST", "url": CHAT, "body": {"model": "\u4e2d" * 300_000}},
                        ensure_ascii=False),  # 900 KB as UTF-8, 1.8 MB as the worker sends it
             line("ok")]
    batch = create(home, store, upload(home, store, lines))
    assert batch.status == BatchState.FAILED and batch.failed_at and batch.request_counts.total == 0
    assert batch.errors is not None
    named = [(error.line, error.param) for error in batch.errors.data]
    assert named == [(2, None), (3, "custom_id"), (4, "url"), (5, "method"), (6, "body"), (7, "extra"),
                     (8, "body.stream"), (9, None), (10, None), (11, None), (12, None), (13, "custom_id"), (14, None),
                     (16, None), (17, "body")]
    assert "NaN is not JSON" in batch.errors.data[8].message and "lone surrogate" in batch.errors.data[9].message
    assert "longer than 1048576 bytes" in batch.errors.data[12].message
    assert "a" not in batch.errors.data[1].message  # names the fault, never echoes the text
    empty = create(home, store, upload(home, store, ["", "  "]))
    assert empty.errors is not None and empty.errors.data[0].code == "empty_file"
    with pytest.raises(Invalid, match="the file is empty"):
        batches.add_file(home, store, owner="x", filename="f", purpose="batch", data=b"", limits=BatchSettings())
    with pytest.raises(Invalid, match="only 'batch' files"):
        batches.add_file(home, store, owner="x", filename="f", purpose="fine-tune", data=b"", limits=BatchSettings())
    files = batches.list_files(home, ANN.subject)
    assert files and all("/" not in f.filename and "\u202e" not in f.filename for f in files)


def test_files_and_batches_are_their_owners_alone(home: Home, store: LocalStore) -> None:
    file_id = upload(home, store, [line("a")])
    with pytest.raises(NotFound):
        create(home, store, file_id, owner=BOB)  # another user's file is as one that does not exist
    batch = create(home, store, file_id)
    with pytest.raises(NotFound):
        batches.get(home, batch.id, BOB.subject)
    with pytest.raises(NotFound):
        batches.cancel(home, batch.id, BOB.subject)
    assert batches.listing(home, BOB.subject) == [] and batches.get(home, batch.id, None).id == batch.id
    assert batch.metadata == {"team": "risk"} and batch.status == BatchState.IN_PROGRESS


def test_quotas_bound_batches_and_waiting_requests_per_user(home: Home, store: LocalStore) -> None:
    limits = BatchSettings(max_active_per_user=2, max_pending_requests_per_user=5, max_requests=4)
    file_id = upload(home, store, [line(str(index)) for index in range(2)])
    create(home, store, file_id, limits=limits)
    create(home, store, file_id, limits=limits)
    with pytest.raises(QuotaExceeded, match="2 batches validating or in progress"):
        create(home, store, file_id, limits=limits)
    bobs = upload(home, store, [line("x")], owner=BOB)
    assert create(home, store, bobs, owner=BOB, limits=limits).status == BatchState.IN_PROGRESS  # per user
    roomy = BatchSettings(max_active_per_user=9, max_pending_requests_per_user=5)
    no_room = create(home, store, file_id, limits=roomy)  # known once the file is read: the batch fails
    assert no_room.errors is not None and no_room.errors.data[0].code == "too_many_pending_requests"
    assert "4 of your batch requests are waiting; 2 more" in no_room.errors.data[0].message
    full = BatchSettings(max_active_per_user=9, max_pending_requests_per_user=4)
    with pytest.raises(QuotaExceeded, match="4 of your batch requests are waiting"):
        create_only(home, file_id, limits=full)  # no room at all: refused at once
    big = create(home, store, upload(home, store, [line(str(index)) for index in range(5)], owner=BOB), owner=BOB,
                 limits=limits)
    assert big.status == BatchState.FAILED and big.errors is not None and big.errors.data[0].code == "too_many_requests"


def test_claims_of_a_dead_worker_return_and_the_output_keeps_input_order(home: Home, store: LocalStore) -> None:
    batch = create(home, store, upload(home, store, [line(f"req-{index}") for index in range(5)]))
    dead = batches.claim(home, 111, lambda pid: False, 3)
    assert batches.claim(home, 333, lambda pid: True, 0) == []  # 111 alive here: its claims stay
    assert [request.line for request in dead] == [1, 2, 3] and dead[0].ref == f"{batch.id}:1"
    assert batches.is_claimed(home, batch.id, 1) and not batches.is_claimed(home, batch.id, 4)
    alive = {222}
    mine = batches.claim(home, 222, lambda pid: pid in alive, 10)  # 111 died: its three are pending again
    assert [request.line for request in mine] == [1, 2, 3, 4, 5]
    for request in reversed(mine):
        status = 400 if request.line == 2 else 200
        batches.finish(home, request, status, f"req-id-{request.line}", {"line": request.line})
    batches.finish(home, mine[0], 200, "twice", {"again": True})  # a request run twice counts once
    assert batches.to_finalize(home) == [batch.id]
    ended = batches.finalize(home, store, batch.id)
    assert ended.status == BatchState.COMPLETED and ended.request_counts.model_dump() == \
        {"total": 5, "completed": 4, "failed": 1}
    assert [b.id for b in batches.to_announce(home)] == [batch.id]
    batches.announced(home, batch.id)
    assert batches.to_announce(home) == []
    batches.finish(home, mine[1], 200, "late", {})  # an answer after the end counts for nothing
    assert batches.get(home, batch.id, None).request_counts.completed == 4
    assert ended.output_file_id and ended.error_file_id and ended.completed_at
    output, key = batches.get_file(home, ended.output_file_id, ANN.subject)
    rows = [json.loads(row) for row in store.get(key).splitlines()]
    assert [row["custom_id"] for row in rows] == ["req-0", "req-2", "req-3", "req-4"]
    assert rows[0]["response"] == {"status_code": 200, "request_id": "req-id-1", "body": {"line": 1}}
    assert output.purpose == "batch_output"
    _, error_key = batches.get_file(home, ended.error_file_id, ANN.subject)
    assert [json.loads(row)["response"]["status_code"] for row in store.get(error_key).splitlines()] == [400]


def test_a_request_whose_workers_keep_dying_fails_and_the_others_go_on(home: Home, store: LocalStore) -> None:
    """One user's request that kills the worker every time must not stop every batch: after
    MAX_REQUEST_CLAIMS dead workers it fails (500 batch_worker_died); a request given back alive
    (a budget spent, an engine down, a worker stopped as asked) never counts as a death."""
    batch = create(home, store, upload(home, store, [line("deadly"), line("fine")]))
    pid = 1000
    for _ in range(batches.MAX_REQUEST_CLAIMS):
        pid += 1
        assert [r.line for r in batches.claim(home, pid, lambda p: False, 1)] == [1]  # the last holder died
    pid += 1
    [survivor] = batches.claim(home, pid, lambda p: p == pid, 5)
    assert survivor.line == 2  # "deadly" was given up, not taken a fourth time
    counts = batches.get(home, batch.id, None).request_counts
    assert (counts.completed, counts.failed) == (0, 1)
    # Given back alive many times: still claimable, its claims back to none each time.
    for _ in range(batches.MAX_REQUEST_CLAIMS + 2):
        batches.release(home, survivor, 0)
        [again] = batches.claim(home, pid, lambda p: p == pid, 5)
        assert again.line == 2
    with batches.connect(home) as db, immediate(db):
        assert batches.REQUESTS.hand_back(db, pid) == 1  # a worker stopped as asked hands its claim back
        assert db.execute("select claims from batch_requests where line = 2").fetchone()[0] == 0
    batches.finish(home, again, 200, "ok", {"fine": True})
    ended = batches.finalize(home, store, batches.to_finalize(home)[0])
    assert ended.request_counts.model_dump() == {"total": 2, "completed": 1, "failed": 1}
    assert ended.error_file_id is not None
    _, error_key = batches.get_file(home, ended.error_file_id, ANN.subject)
    [failure] = [json.loads(row)["response"] for row in store.get(error_key).splitlines()]
    assert failure["status_code"] == 500 and failure["body"]["error"]["code"] == "batch_worker_died"
    assert "died 3 times" in failure["body"]["error"]["message"]


def test_cancel_lets_running_requests_finish_and_keeps_their_answers(home: Home, store: LocalStore) -> None:
    batch = create(home, store, upload(home, store, [line(f"r{index}") for index in range(4)]))
    [running] = batches.claim(home, 7, lambda pid: True, 1)
    cancelling = batches.cancel(home, batch.id, ANN.subject)
    assert cancelling.status == BatchState.CANCELLING and cancelling.cancelling_at
    assert batches.claim(home, 8, lambda pid: True, 5) == []  # no other starts
    assert batches.to_finalize(home) == []  # one still running
    batches.finish(home, running, 200, "x", {"ok": True})
    ended = batches.finalize(home, store, batches.to_finalize(home)[0])
    assert ended.status == BatchState.CANCELLED and ended.request_counts.completed == 1 and ended.output_file_id
    with pytest.raises(Conflict, match="only a batch validating or in progress"):
        batches.cancel(home, batch.id, ANN.subject)
    other = create(home, store, upload(home, store, [line("z")]))
    assert batches.cancel_all_of(home, ANN.subject) == 1
    assert batches.get(home, other.id, None).status == BatchState.CANCELLING


def test_a_batch_past_its_window_expires_with_its_unrun_requests_failed(home: Home, store: LocalStore) -> None:
    batch = create(home, store, upload(home, store, [line("a"), line("b")]))
    [first] = batches.claim(home, 7, lambda pid: True, 1)
    batches.finish(home, first, 200, "x", {"ok": True})
    db = sqlite3.connect(home.root / "batches.sqlite")
    db.execute("update batches set expires_at = 0 where id = ?", (batch.id,))
    db.commit()
    db.close()
    assert batches.claim(home, 7, lambda pid: True, 5) == []  # an expired batch starts nothing more
    ended = batches.finalize(home, store, batches.to_finalize(home)[0])
    assert ended.status == BatchState.EXPIRED and ended.request_counts.model_dump() == \
        {"total": 2, "completed": 1, "failed": 1}
    _, key = batches.get_file(home, ended.error_file_id or "", ANN.subject)
    [expired] = [json.loads(row) for row in store.get(key).splitlines()]
    assert expired["custom_id"] == "b" and expired["error"]["code"] == "batch_expired"
    assert (home.root / "batches.sqlite").stat().st_mode & 0o077 == 0


def test_files_count_against_a_storage_quota_and_deleting_frees_it(home: Home, store: LocalStore) -> None:
    limits = BatchSettings(max_stored_bytes_per_user=2048)
    first = batches.add_file(home, store, owner=ANN.subject, filename="a", purpose="batch", data=b"x" * 1500,
                             limits=limits)
    with pytest.raises(QuotaExceeded, match="your files hold 1500 bytes"):
        batches.add_file(home, store, owner=ANN.subject, filename="b", purpose="batch", data=b"x" * 1000,
                         limits=limits)
    batches.add_file(home, store, owner=BOB.subject, filename="b", purpose="batch", data=b"x" * 1000, limits=limits)
    with pytest.raises(NotFound):
        batches.delete_file(home, store, first.id, BOB.subject)  # only its owner's
    batches.delete_file(home, store, first.id, ANN.subject)
    assert store.keys("batches/files/") == [key for key in store.keys("batches/files/") if first.id not in key]
    with pytest.raises(NotFound):
        batches.get_file(home, first.id, ANN.subject)
    batches.add_file(home, store, owner=ANN.subject, filename="b", purpose="batch", data=b"x" * 1000, limits=limits)


def test_a_request_given_back_waits_its_turn_and_users_take_turns(home: Home, store: LocalStore) -> None:
    anns = create(home, store, upload(home, store, [line(f"a{index}") for index in range(4)]))
    bobs = create(home, store, upload(home, store, [line(f"b{index}") for index in range(2)], owner=BOB), owner=BOB)
    first = batches.claim(home, 5, lambda pid: True, 2)
    assert [request.batch_id for request in first] == [anns.id, bobs.id]  # one each, not Ann's whole batch
    batches.release(home, first[0], 60)  # Ann's budget is spent: her request waits, Bob's go on
    batches.finish(home, first[1], 200, "x", {})
    again = batches.claim(home, 5, lambda pid: True, 3)
    assert [(r.batch_id, r.line) for r in again] == [(anns.id, 2), (bobs.id, 2), (anns.id, 3)]
    mine_after_restart = batches.claim(home, 5, lambda pid: True, 10)  # same pid, new process: stale claims free
    assert {(r.batch_id, r.line) for r in mine_after_restart} >= {(r.batch_id, r.line) for r in again}
    assert (anns.id, 1) not in {(r.batch_id, r.line) for r in mine_after_restart}  # not before its retry time
    failing = next(r for r in mine_after_restart if r.batch_id == anns.id)
    batches.release(home, failing, 0, failed=True)  # an engine failed mid-answer: an attempt counted
    [again] = [r for r in batches.claim(home, 6, lambda pid: True, 10) if (r.batch_id, r.line) ==
               (failing.batch_id, failing.line)]
    assert again.attempts == 1


def test_an_upload_is_copied_to_the_store_from_its_spool_in_pieces(tmp_path: Path, home: Home,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The upload's spooled file goes to the store a piece at a time (never read whole), and the
    stored bytes and the quota count are the file's."""
    store = LocalStore(tmp_path / "store")
    monkeypatch.setattr(durable, "PIECE_BYTES", 1000)
    reads: list[int] = []
    spool = tempfile.SpooledTemporaryFile(max_size=100)
    spool.write(b'{"custom_id": "a"}\n' * 500)
    spool.seek(0)
    original = spool.read
    spool.read = lambda size=-1: reads.append(size) or original(size)  # type: ignore[method-assign]
    file = batches.add_file(home, store, owner="x", filename="f", purpose="batch", data=spool,  # type: ignore[arg-type]
                            limits=BatchSettings())
    assert file.bytes == 19 * 500
    assert store.get(f"batches/files/{file.id}") == b'{"custom_id": "a"}\n' * 500
    assert reads and max(reads) == 1000 and -1 not in reads


def test_a_batch_whose_owner_can_no_longer_run_it_fails_its_remaining_requests(home: Home, store: LocalStore) -> None:
    batch = create(home, store, upload(home, store, [line(f"r{index}") for index in range(5)]))
    [first, second] = batches.claim(home, 7, lambda pid: True, 2)
    batches.finish(home, first, 200, "ok", {"ok": True})
    refusal = {"error": {"message": "the 'user' or 'admin' role is required", "code": "missing_role"}}
    assert batches.fail_remaining(home, batch.id, 403, refusal) == 3  # the one being sent gets its own answer
    assert batches.claim(home, 8, lambda pid: True, 5) == []
    batches.finish(home, second, 403, "refused", refusal)
    ended = batches.finalize(home, store, batches.to_finalize(home)[0])
    assert ended.request_counts.model_dump() == {"total": 5, "completed": 1, "failed": 4}
    assert ended.error_file_id is not None
    _, error_key = batches.get_file(home, ended.error_file_id, ANN.subject)
    failures = [json.loads(row)["response"] for row in store.get(error_key).splitlines()]
    assert [f["status_code"] for f in failures] == [403] * 4
    assert all(f["body"]["error"]["code"] == "missing_role" for f in failures)
    assert batches.fail_remaining(home, batch.id, 403, refusal) == 0, "an ended batch is left as it is"


@pytest.mark.parametrize(("code", "failed"), [
    *[(code, 4) for code in sorted(batch_worker.OWNER_REFUSALS)],  # the owner cannot run it: the rest fail at once
    ("model_not_allowed", 1), ("adapter_forbidden", 1), (None, 1),  # this request's own fault: the others go on
])
def test_the_worker_fails_the_rest_of_a_batch_only_when_its_owner_can_no_longer_run_it(
        home: Home, store: LocalStore, monkeypatch: pytest.MonkeyPatch, code: str | None, failed: int) -> None:
    worker = batch_worker.Worker(Settings(), home)
    worker.store = store
    monkeypatch.setattr(batch_worker, "worker_alive", lambda pid: True)
    sent: list[str] = []

    def gateway(request: httpx.Request) -> httpx.Response:
        sent.append(request.headers[batches.BATCH_HEADER])
        if len(sent) == 1:  # the first request is refused; the owner's state has changed
            return httpx.Response(403, json={"error": {"message": "refused", "type": "permission_error",
                                                       **({"code": code} if code else {})}})
        return httpx.Response(200, json={"choices": [{"message": {"content": "ok"}}]})

    worker.http = httpx.Client(base_url="http://gateway", transport=httpx.MockTransport(gateway))
    create_only(home, upload(home, store, [line(f"r{index}") for index in range(4)]))
    assert worker.validate_next()
    while claimed := batches.claim(home, 99, lambda pid: True, 1):
        worker.execute(claimed[0])
    ended = batches.finalize(home, store, batches.to_finalize(home)[0])
    assert ended.request_counts.model_dump() == {"total": 4, "completed": 4 - failed, "failed": failed}
    assert len(sent) == 5 - failed, "no request of a batch its owner can no longer run is sent"


def test_a_batch_names_its_owner_by_username_in_every_view(home: Home, store: LocalStore) -> None:
    """Listings of every user's batches (the CLI, the TUI) say whose each is: the creator's
    username, not their token's subject."""
    made = create(home, store, upload(home, store, [line("a")], owner=BOB), owner=BOB)
    assert made.owner == "bob"
    assert batches.get(home, made.id, None).owner == "bob"
    assert [b.owner for b in batches.listing(home, None)] == ["bob"]
