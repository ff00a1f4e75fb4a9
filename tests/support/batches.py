"""Batch queue helpers: owners, input lines, and batches created and validated as the gateway and
the worker do."""

from __future__ import annotations

import json

from appliance import batches
from appliance.artifacts import LocalStore
from appliance.batches import BatchAsk, BatchState, Owner
from appliance.batches.lines import Reader, read_chunks
from appliance.batches.validation import CHUNK_ROWS
from appliance.home import Home
from appliance.settings import BatchSettings

ANN = Owner("sub-ann", "ann", frozenset({"user"}))
BOB = Owner("sub-bob", "bob", frozenset({"user"}))
CHAT = "/v1/chat/completions"


def line(custom_id: str, **overrides: object) -> str:
    """One input line: a chat completion asking `custom_id`, with `overrides` applied."""
    item = {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"model": "m", "messages": [{"role": "user", "content": custom_id}]}, **overrides}
    return json.dumps(item)


def upload(home: Home, store: LocalStore, lines: list[str], owner: Owner = ANN) -> str:
    """An input file of `lines`, under a name that tries to leave its directory; its id."""
    data = ("\n".join(lines) + "\n").encode()
    return batches.add_file(home, store, owner=owner.subject, filename="../../etc/in\u202e.jsonl", purpose="batch",
                            data=data, limits=BatchSettings()).id


def create_only(home: Home, file_id: str, owner: Owner = ANN, limits: BatchSettings | None = None) -> batches.Batch:
    """A batch as the gateway answers it: validating."""
    ask = BatchAsk(input_file_id=file_id, endpoint=CHAT, completion_window="24h", metadata={"team": "risk"})
    return batches.create(home, ask, owner, limits or BatchSettings())


def validate(home: Home, store: LocalStore, limits: BatchSettings | None = None, max_choices: int | None = None,
             pid: int = 4242, *, read: Reader = read_chunks, chunk_rows: int = CHUNK_ROWS) -> batches.Batch:
    """The next validating batch, validated as the worker does (`read` and `chunk_rows`: how the
    file is read and copied, validate's own seams)."""
    job = batches.claim_validation(home, pid, lambda other: other == pid)
    assert job is not None
    return batches.validate(home, store, job, limits or BatchSettings(), 1 << 20, max_choices, read=read,
                            chunk_rows=chunk_rows)


def create(home: Home, store: LocalStore, file_id: str, owner: Owner = ANN,
           limits: BatchSettings | None = None) -> batches.Batch:
    """A batch created, then validated by the worker."""
    created = create_only(home, file_id, owner, limits)
    assert created.status == BatchState.VALIDATING and created.request_counts.total == 0
    validated = validate(home, store, limits)
    assert validated.id == created.id
    return validated
