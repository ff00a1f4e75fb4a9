"""Batch validation off the gateway: creating a batch answers `validating` at once; the worker
reads the input file as a stream, copies its requests in chunks, starts over after a crash without
copying twice, stops when the batch is cancelled, and fails it naming each line and field (the
choices a line asks for included). Failed validations count against a quota."""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Iterator
from functools import partial

import httpx
import pytest

from appliance import batches
from appliance.artifacts import ArtifactStore, LocalStore
from appliance.batches import BatchState
from appliance.batches import store as batch_store
from appliance.batches.lines import read_chunks, split_lines
from appliance.errors import ArtifactStoreError, QuotaExceeded
from appliance.home import Home
from appliance.settings import BatchSettings, Settings
from serve import batch_worker
from tests.support.batches import ANN, BOB, CHAT, create_only, line, upload, validate

COMPLETIONS = "/v1/completions"


def rows(home: Home, batch_id: str) -> list[tuple[int, str]]:
    with batches.connect(home) as db:
        return [(row[0], row[1]) for row in db.execute(
            "select line, custom_id from batch_requests where batch_id = ? order by line", (batch_id,))]


def test_lines_are_split_alike_whatever_the_chunks() -> None:
    data = b'{"a": 1}\n\n{"b": "\xe2\x80\xa8"}\r\n' + b"x" * 40 + b"\nlast"
    for size in (1, 3, 7, 64, 1 << 20):
        chunks = [data[start:start + size] for start in range(0, len(data), size)]
        found = list(split_lines(chunks, 32))
        assert found == [(1, b'{"a": 1}'), (2, b""), (3, b'{"b": "\xe2\x80\xa8"}\r'), (4, None), (5, b"last")]
    assert list(split_lines([b"a\n"], 8)) == [(1, b"a")]  # a final "\n" ends the last line


def test_creating_answers_validating_and_the_worker_copies_in_chunks(home: Home, store: LocalStore) -> None:
    created = create_only(home, upload(home, store, [line(f"r{index}") for index in range(50)]))
    assert created.status == BatchState.VALIDATING and created.in_progress_at is None
    assert batches.claim(home, 1, lambda pid: True, 10) == []  # nothing runs before it is validated
    batch = validate(home, store, read=partial(read_chunks, size=100), chunk_rows=7)  # many reads, lines across them
    assert batch.status == BatchState.IN_PROGRESS and batch.in_progress_at and batch.request_counts.total == 50
    assert rows(home, batch.id) == [(index + 1, f"r{index}") for index in range(50)]
    assert batches.claim_validation(home, 4242, lambda pid: True) is None
    assert batches.get(home, batch.id, ANN.subject).errors is None


def test_users_take_turns_at_validation(home: Home, store: LocalStore) -> None:
    anns = [create_only(home, upload(home, store, [line("a")])).id for _ in range(2)]
    bobs = create_only(home, upload(home, store, [line("b")], owner=BOB), owner=BOB).id
    order = [validate(home, store).id for _ in range(3)]
    assert order == [anns[0], bobs, anns[1]]  # one user's queue of big files does not hold the others back


def test_a_crash_mid_validation_starts_over_without_copying_twice(home: Home, store: LocalStore) -> None:
    batch = create_only(home, upload(home, store, [line(f"r{index}") for index in range(40)]))
    small_reads = partial(read_chunks, size=256)

    def dying(store: ArtifactStore, key: str) -> Iterator[bytes]:
        chunks = small_reads(store, key)
        for _ in range(4):
            yield next(chunks)
        raise ArtifactStoreError("the store went away")

    with pytest.raises(ArtifactStoreError):
        validate(home, store, pid=11, read=dying, chunk_rows=2)
    assert 0 < len(rows(home, batch.id)) < 40  # chunks copied before the crash
    assert batches.claim_validation(home, 12, lambda pid: pid == 11) is None  # 11 lives: its claim holds
    # 11 died (12 knows only itself alive): 12 starts over
    done = validate(home, store, pid=12, read=small_reads, chunk_rows=2)
    assert done.status == BatchState.IN_PROGRESS and done.request_counts.total == 40
    assert rows(home, batch.id) == [(index + 1, f"r{index}") for index in range(40)]


def test_cancelling_a_validating_batch_stops_its_validation(home: Home, store: LocalStore) -> None:
    batch = create_only(home, upload(home, store, [line(f"r{index}") for index in range(40)]))

    def cancelled_meanwhile(store: ArtifactStore, key: str) -> Iterator[bytes]:
        for number, chunk in enumerate(read_chunks(store, key, size=256)):
            if number == 3:
                assert batches.cancel(home, batch.id, ANN.subject).status == BatchState.CANCELLING
            yield chunk

    stopped = validate(home, store, read=cancelled_meanwhile, chunk_rows=5)
    assert stopped.status == BatchState.CANCELLING and stopped.request_counts.total == 0
    assert rows(home, batch.id) == []  # what it had copied is gone
    ended = batches.finalize(home, store, batches.to_finalize(home)[0])
    assert ended.status == BatchState.CANCELLED and ended.output_file_id is None and ended.in_progress_at is None
    waiting = create_only(home, upload(home, store, [line("x")]))
    assert batches.cancel_all_of(home, ANN.subject) == 1  # a disabled user's validating batches too
    assert batches.get(home, waiting.id, None).status == BatchState.CANCELLING
    assert batches.claim_validation(home, 1, lambda pid: True) is None


def test_each_line_is_capped_at_the_choices_the_owner_may_ask_for(home: Home, store: LocalStore) -> None:
    def completion(custom_id: str, **body: object) -> str:
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": COMPLETIONS,
                           "body": {"model": "m", "prompt": "hi", **body}})

    lines = [completion("a", prompt=["x", "y", "z"], n=2), completion("b", n=5), completion("c", best_of=3, n=2),
             completion("d", n="2"), completion("e", n=True), completion("f", prompt=[1, 2, 3], n=4),
             completion("g", prompt=[[1], [2]], n=2), completion("h", best_of=0)]
    file_id = upload(home, store, lines)
    ask = batches.BatchAsk(input_file_id=file_id, endpoint=COMPLETIONS, completion_window="24h")
    batches.create(home, ask, ANN, BatchSettings())
    batch = validate(home, store, max_choices=4)
    assert batch.errors is not None
    named = [(error.line, error.param) for error in batch.errors.data]
    assert named == [(1, "body.prompt"), (2, "body.n"), (3, "body.best_of"), (4, "body.n"), (5, "body.n"),
                     (8, "body.best_of")]
    assert batch.errors.data[0].message == \
        "6 choices asked (3 prompts x n 2); your role allows 4 (gateway.limits max_n)"
    assert "n must be a positive integer" in batch.errors.data[3].message
    batches.create(home, ask, ANN, BatchSettings())
    uncapped = validate(home, store, max_choices=None).errors  # no cap (a role not limited): only the types
    assert uncapped is not None and [(error.line, error.param) for error in uncapped.data] == \
        [(3, "body.best_of"), (4, "body.n"), (5, "body.n"), (8, "body.best_of")]


def test_failed_validations_count_against_a_quota(home: Home, store: LocalStore) -> None:
    limits = BatchSettings(max_failed_validations_per_hour=2)
    bad = upload(home, store, ["not json"])
    for _ in range(2):
        create_only(home, bad, limits=limits)
        assert validate(home, store, limits).status == BatchState.FAILED
    with pytest.raises(QuotaExceeded, match="2 of your batches failed validation"):
        create_only(home, upload(home, store, [line("fine")]), limits=limits)
    create_only(home, upload(home, store, [line("fine")], owner=BOB), owner=BOB, limits=limits)  # per user
    db = sqlite3.connect(home.root / "batches.sqlite")
    db.execute("update batches set failed_at = failed_at - 3601")  # an hour later
    db.commit()
    db.close()
    cancelled = create_only(home, upload(home, store, [line("fine")]), limits=limits)
    batches.cancel(home, cancelled.id, ANN.subject)  # cancelled while validating: counted too
    create_only(home, upload(home, store, [line("fine")]), limits=limits)


def test_every_validation_counts_its_bytes_whatever_becomes_of_the_batch(home: Home, store: LocalStore) -> None:
    """A batch validated and then cancelled at once cost a read of its whole file too: the bytes
    validated in the hour are counted, so validations cannot be repeated at will."""
    file_id = upload(home, store, [line(str(n)) for n in range(50)])
    size = batches.get_file(home, file_id, ANN.subject)[0].bytes
    limits = BatchSettings(max_validated_bytes_per_hour=3 * size)
    for _ in range(3):
        batch = create_only(home, file_id, limits=limits)
        assert validate(home, store, limits).status == BatchState.IN_PROGRESS
        batches.cancel(home, batch.id, ANN.subject)
    with pytest.raises(QuotaExceeded, match="max_validated_bytes_per_hour"):
        create_only(home, file_id, limits=limits)
    create_only(home, upload(home, store, [line("a")], owner=BOB), owner=BOB, limits=limits)  # per user
    db = sqlite3.connect(home.root / "batches.sqlite")
    db.execute("update batches set created_at = created_at - 3601")  # an hour later
    db.commit()
    db.close()
    create_only(home, file_id, limits=limits)


def test_an_input_file_deleted_before_validation_fails_the_batch(home: Home, store: LocalStore) -> None:
    file_id = upload(home, store, [line("a")])
    create_only(home, file_id)
    batches.delete_file(home, store, file_id, ANN.subject)
    batch = validate(home, store)
    assert batch.status == BatchState.FAILED and batch.errors is not None
    [error] = batch.errors.data
    assert (error.code, error.param) == ("invalid_file", "input_file_id") and file_id in error.message
    assert [ended.id for ended in batches.to_announce(home)] == [batch.id]  # its failure goes to the audit log
    assert batch_worker._ending(batch).startswith(f"batch {batch.id} failed validation (1 errors; first at the file")


def test_a_queue_from_before_gets_the_new_column_and_leaves_old_failures_unannounced(home: Home) -> None:
    old_schema = re.sub(r"\n *(validator_pid|input_bytes|api_key) [^\n]*", "", batch_store.SCHEMA).replace(
        "default 0,  -- its end", "default 0  -- its end")
    assert "validator_pid" not in old_schema and "input_bytes" not in old_schema and "api_key" not in old_schema
    db = sqlite3.connect(home.root / "batches.sqlite")
    db.executescript(old_schema)
    db.execute("insert into batches (id, owner, username, roles, endpoint, input_file_id, completion_window, status, "
               "created_at, expires_at, failed_at) values ('batch_old', 'o', 'u', '[]', ?, 'f', '24h', 'failed', 1, "
               "2, 1)", (CHAT,))
    db.commit()
    db.close()
    batch_store._READY.discard(home.root / "batches.sqlite")
    assert batches.to_announce(home) == []
    with batches.connect(home) as db:
        columns = {row[1] for row in db.execute("pragma table_info(batches)")}
    assert {"validator_pid", "input_bytes", "api_key"} <= columns
    assert batches.get(home, "batch_old", None).status == BatchState.FAILED


def test_a_batch_left_validating_by_a_queue_from_before_queued_validations_is_validated(
        home: Home, store: LocalStore) -> None:
    """A queue written before validations had a table of their own: its batch waiting for the
    worker (claimed by a worker since gone) is validated after the upgrade, once."""
    batch = create_only(home, upload(home, store, [line("r0"), line("r1")]))
    with batches.connect(home) as db:
        db.execute("drop table batch_validations")
        db.execute("update batches set validator_pid = 999999 where id = ?", (batch.id,))
        db.commit()
    batch_store._READY.discard(home.root / "batches.sqlite")
    done = validate(home, store)
    assert done.id == batch.id and done.status == BatchState.IN_PROGRESS and done.request_counts.total == 2
    assert batches.claim_validation(home, 4243, lambda pid: False) is None  # done: no worker takes it again


def test_a_file_the_worker_dies_on_fails_its_batch_after_the_bound_on_retries(home: Home, store: LocalStore) -> None:
    """Each worker that takes the validation dies on it; after MAX_VALIDATION_ATTEMPTS the batch
    fails saying so, and the next batch is validated (one poisonous file stops no one else)."""
    poison = create_only(home, upload(home, store, [line("r0")]))
    pids = range(11, 11 + batches.MAX_VALIDATION_ATTEMPTS)
    for pid in pids:  # each claims it, then dies (the next knows only itself alive)
        taken = batches.claim_validation(home, pid, lambda alive: False)
        assert taken is not None and taken.batch_id == poison.id
    after = create_only(home, upload(home, store, [line("r1")]))
    assert validate(home, store, pid=99).id == after.id
    failed = batches.get(home, poison.id, ANN.subject)
    assert failed.status == BatchState.FAILED and failed.failed_at and failed.request_counts.total == 0
    assert failed.errors is not None and [error.code for error in failed.errors.data] == ["validation_failed"]
    assert str(batches.MAX_VALIDATION_ATTEMPTS) in failed.errors.data[0].message
    assert batches.claim_validation(home, 100, lambda alive: False) is None


def test_a_validation_queue_from_before_retries_were_counted_counts_them(home: Home, store: LocalStore) -> None:
    batch = create_only(home, upload(home, store, [line("r0")]))
    with batches.connect(home) as db:
        db.execute("drop index batch_validations_state")
        db.execute("alter table batch_validations drop column attempts")
        db.commit()
    batch_store._READY.discard(home.root / "batches.sqlite")
    done = validate(home, store)
    assert done.id == batch.id and done.status == BatchState.IN_PROGRESS
    with batches.connect(home) as db:
        assert db.execute("select attempts from batch_validations").fetchone()[0] == 1


def test_the_worker_validates_and_a_line_the_gateway_refuses_ends_in_the_error_file(
        home: Home, store: LocalStore, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings()
    worker = batch_worker.Worker(settings, home)
    worker.store = store
    monkeypatch.setattr(batch_worker, "worker_alive", lambda pid: True)

    def gateway(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body["messages"][0]["content"] == "refused":
            return httpx.Response(400, json={"error": {"message": "n: 8 is over your role's cap", "param": "n"}})
        return httpx.Response(200, json={"choices": [{"message": {"content": "ok"}}]}, headers={"x-request-id": "r"})

    worker.http = httpx.Client(base_url="http://gateway", transport=httpx.MockTransport(gateway))
    batch = create_only(home, upload(home, store, [line("fine"), line("refused")]))
    assert worker.validate_next() and not worker.validate_next()
    for request in batches.claim(home, 99, lambda pid: True, 10):
        worker.execute(request)
    ended = batches.finalize(home, store, batches.to_finalize(home)[0])
    assert ended.id == batch.id and ended.request_counts.model_dump() == {"total": 2, "completed": 1, "failed": 1}
    _, key = batches.get_file(home, ended.error_file_id or "", ANN.subject)
    [refused] = [json.loads(row) for row in store.get(key).splitlines()]
    assert refused["custom_id"] == "refused" and refused["response"]["status_code"] == 400
    assert refused["response"]["body"]["error"]["param"] == "n"


def test_a_request_with_no_answer_in_time_is_retried_then_fails_with_504(
        home: Home, store: LocalStore, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(batch={"max_attempts": 2}, watchdog={"batch_stall_s": 600})
    worker = batch_worker.Worker(settings, home)
    assert worker.http.timeout.read == 300, "half the watchdog's stall limit: never a worker taken for stuck"
    worker.store = store
    monkeypatch.setattr(batch_worker, "worker_alive", lambda pid: True)
    monkeypatch.setattr(batch_worker, "FAILED_RETRY_S", 0.0)

    def gateway(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("no answer", request=request)

    worker.http = httpx.Client(base_url="http://gateway", transport=httpx.MockTransport(gateway))
    create_only(home, upload(home, store, [line("slow")]))
    assert worker.validate_next()
    for _ in range(2):  # given back once as a failure that may pass, then failed
        [request] = batches.claim(home, 99, lambda pid: True, 10)
        worker.execute(request)
    ended = batches.finalize(home, store, batches.to_finalize(home)[0])
    assert ended.request_counts.model_dump() == {"total": 1, "completed": 0, "failed": 1}
    _, key = batches.get_file(home, ended.error_file_id or "", ANN.subject)
    [failed] = [json.loads(row) for row in store.get(key).splitlines()]
    assert failed["response"]["status_code"] == 504
    assert failed["response"]["body"]["error"]["code"] == "batch_request_timeout"
