"""The Batch API's files: uploads kept in the artifact store within their owner's quota, listed,
read and deleted; a batch's output files are written by appliance.batches.output."""

from __future__ import annotations

import io
from typing import BinaryIO

from appliance.artifacts import ArtifactStore
from appliance.batches.records import FileObject
from appliance.batches.store import connect, new_id, transaction, unix_time
from appliance.errors import Invalid, NotFound, QuotaExceeded
from appliance.home import Home
from appliance.settings import BatchSettings

PURPOSE = "batch"


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
    file = FileObject(id=new_id("file-"), bytes=size, created_at=unix_time(), filename=_safe_name(filename),
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
