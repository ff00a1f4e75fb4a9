"""The append-only audit log: hash-chained records, durable before `append` returns, with fsyncs
shared by concurrent writers (group commit), size-based rotation that keeps the chain, and
Ed25519-signed checkpoints every N records or T seconds.

Several processes may write one log (the gateway, and the CLI for local changes): records are
chained only while holding an exclusive lock on the log directory's `.lock`, after catching up
with whatever another process appended.

Layout of the log directory:
    audit-000001.jsonl, audit-000002.jsonl, ...   records, one canonical JSON line each
    checkpoints.jsonl                             signed (seq, head hash, time) statements
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from appliance.durable import fsync_directory
from audit.keys import key_id
from audit.records import GENESIS, AuditEvent, AuditRecord, canonical, digest

CHECKPOINTS = "checkpoints.jsonl"
LOCK = ".lock"
RETRY_AFTER_S = 2.0
TAIL_CHUNK = 1 << 16


class AuditUnavailable(Exception):
    """The log cannot be written: callers must fail closed."""


def log_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("audit-*.jsonl"))


def complete_lines(data: bytes) -> list[bytes]:
    """The newline-terminated lines of a log or checkpoints file read while a writer may be
    appending: what follows the last newline is still being written."""
    return data[:data.rfind(b"\n") + 1].splitlines()


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


@dataclass
class _Waiting:
    """An appended event until the flush that chains and writes it says how it went."""

    fields: dict[str, Any]
    record: AuditRecord | None = None
    error: str | None = None


class AuditWriter:
    """Thread-safe appender. `append` returns once the record (and every record before it) is on
    disk; writers that arrive while a flush is running are written and fsynced by the next one."""

    def __init__(self, directory: Path, signer: Ed25519PrivateKey, *, checkpoint_every: int = 1000,
                 checkpoint_interval_s: float = 60.0, max_file_bytes: int = 64 << 20) -> None:
        self.directory = directory
        self._signer = signer
        self._key_id = key_id(signer)
        self._every = checkpoint_every
        self._interval = checkpoint_interval_s
        self._max_bytes = max_file_bytes
        self._cond = threading.Condition()
        self._pending: list[_Waiting] = []
        self._flushing = False
        self._failure: str | None = None
        self._failed_at = 0.0
        self._fd: int | None = None
        self.last_flush_s = 0.0  # how long the latest batch took to chain, write and flush
        # What an alert can hold while a failure is retried (the failure itself clears at each retry):
        self.write_failures = 0  # writes (a batch of records, a checkpoint) that failed, ever
        self.last_write_at = time.time()  # when the log last took records (Unix time; at first, its opening)
        # Records name users and what they did: private to the appliance, like its secrets.
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
        self._lock_fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        with self._locked():
            self._load_head()
            self._checkpointed_seq = self._last_checkpoint_seq()
        self._checkpointed_at = time.monotonic()

    # -- state ------------------------------------------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Exclusive use of the log among processes, for chaining and writing."""
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _load_head(self) -> None:
        """Find the chain head on disk. A torn last line (a writer crashed mid-write) was never
        acknowledged, so it is cut off; anything else unreadable stops the writer (verify says
        why). Call with the lock held."""
        self._close_file()
        self._seq, self._head = 0, GENESIS
        files = log_files(self.directory)
        self._file = files[-1] if files else self.directory / "audit-000001.jsonl"
        for path in reversed(files[-2:]):  # the newest file may be empty just after rotation
            last = _last_line(path, cut_torn=path == self._file)
            if last is not None:
                record = json.loads(last)
                self._seq, self._head = int(record["seq"]), str(record["hash"])
                break

    def _catch_up(self) -> None:
        """Re-read the head if another process appended or rotated since our last write."""
        if self._fd is not None and os.fstat(self._fd).st_size == self._size \
                and not self._next_file().exists():
            return
        self._load_head()

    def _next_file(self) -> Path:
        number = int(self._file.stem.split("-")[1]) + 1
        return self.directory / f"audit-{number:06d}.jsonl"

    def _last_checkpoint_seq(self) -> int:
        """Sequence number of the last checkpoint (a torn one, never completed, is cut off)."""
        path = self.directory / CHECKPOINTS
        last = _last_line(path, cut_torn=True) if path.exists() else None
        return int(json.loads(last)["seq"]) if last else 0

    @property
    def failure(self) -> str | None:
        """Why the log is not writable, or None (see `check` to also retry)."""
        return self._failure

    def check(self) -> str | None:
        """Why the log is not writable, or None; after a failure, retries now and then."""
        if self._failure is None:
            return None  # one read: never waits behind a flush or a checkpoint in another thread
        with self._cond:
            self._retry_after_failure()
            return self._failure

    @property
    def head(self) -> tuple[int, str]:
        """(last durable sequence number, its hash), as of this writer's last write."""
        with self._cond:
            while self._flushing:
                self._cond.wait()
            return self._seq, self._head

    # -- appending --------------------------------------------------------------------------

    def append(self, event: AuditEvent) -> AuditRecord:
        """Chain, write and fsync `event`; raise AuditUnavailable if it cannot be made durable."""
        with self._cond:
            self._retry_after_failure()
            if self._failure is not None:
                raise AuditUnavailable(self._failure)
            waiting = _Waiting(event.model_dump())
            self._pending.append(waiting)
            while waiting.record is None:
                if waiting.error is not None:
                    raise AuditUnavailable(waiting.error)
                if self._flushing:
                    self._cond.wait()
                    continue
                self._flushing = True
                batch, self._pending = self._pending, []
                self._cond.release()
                started = time.monotonic()
                unwritten = batch + self._pending
                try:
                    failure = self._write(batch)  # the batch is durable; a failure is its checkpoint's
                    unwritten = self._pending
                except OSError as exc:
                    failure = f"audit log {self.directory} is not writable: {exc.strerror or exc}"
                except (ValueError, KeyError) as exc:
                    failure = f"audit log {self.directory} cannot be read back: {exc}"
                except Exception as exc:  # anything else fails closed too, and says what it was
                    failure = f"audit log {self.directory} failed: {type(exc).__name__}: {exc}"
                finally:
                    self.last_flush_s = time.monotonic() - started
                    self._cond.acquire()
                    self._flushing = False
                if failure is not None:
                    self._failure, self._failed_at = failure, time.monotonic()
                    self.write_failures += 1
                    for failed in unwritten:  # none of these reached the disk
                        failed.error = failure
                    self._pending = []
                self._cond.notify_all()
        return waiting.record

    def _retry_after_failure(self) -> None:
        """Once in a while after a failure (disk full, say), let the next append try again; it
        re-reads the head from disk: records that never got there were never acknowledged."""
        if self._failure is None or self._flushing or time.monotonic() - self._failed_at < RETRY_AFTER_S:
            return
        self._failure = None

    def _write(self, batch: list[_Waiting]) -> str | None:
        """Chain a batch onto the head on disk and append it with one write and one fsync (only
        the flushing thread gets here). Raises OSError if the batch is not durable (and is not in
        the log either); returns why a checkpoint due after it could not be written, if so."""
        with self._locked():
            self._catch_up()
            fd = self._open() if self._fd is None else self._fd
            if self._size >= self._max_bytes:
                self._close_file()
                self._file = self._next_file()
                fd = self._open()
            seq, head, now = self._seq, self._head, _now()
            chained = []
            for waiting in batch:
                fields = {**waiting.fields, "seq": seq + 1, "time": now, "prev_hash": head}
                seq, head = seq + 1, digest(fields)
                chained.append({**fields, "hash": head})
            data = b"".join(canonical(fields) + b"\n" for fields in chained)
            try:
                written = os.write(fd, data)
                while written < len(data):
                    written += os.write(fd, data[written:])
                os.fdatasync(fd)  # the data and the size it needs; not the mtime
            except OSError:
                # Unacknowledged records must not stay in the chain: cut them off if the disk lets us.
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, self._size)
                self._close_file()  # the head is re-read (and a torn tail cut) on the next write
                raise
            self._size += len(data)
            self._seq, self._head = seq, head
            self.last_write_at = time.time()
            signing_failure = None
            if (self._seq - self._checkpointed_seq >= self._every
                    or time.monotonic() - self._checkpointed_at >= self._interval):
                try:
                    self._sign_head()
                except OSError as exc:
                    signing_failure = f"audit checkpoints in {self.directory} are not writable: {exc.strerror or exc}"
        # Only now, durable, may the waiters see their records. The fields come from validated
        # AuditEvents: no need to validate them again.
        for waiting, fields in zip(batch, chained, strict=True):
            waiting.record = AuditRecord.model_construct(**fields)
        return signing_failure

    def _open(self) -> int:
        """Open the current log file for appending; its descriptor."""
        new = not self._file.exists()
        self._fd = fd = os.open(self._file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._size = os.fstat(fd).st_size
        if new:
            fsync_directory(self.directory)  # the new file's name must survive a crash too
        return fd

    def _close_file(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._size = 0

    def close(self) -> None:
        """Release the open log file and the lock file; the writer is done."""
        with self._cond:
            self._close_file()
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1

    # -- checkpoints ------------------------------------------------------------------------

    def checkpoint(self) -> dict[str, int | str] | None:
        """Sign the current head now (also called on a timer); None if nothing new."""
        with self._cond:
            while self._flushing or self._pending:
                self._cond.wait()
            if self._failure is not None:
                return None
            try:
                with self._locked():
                    self._catch_up()  # sign the head on disk, other processes' records included
                    return self._sign_head() if self._seq > self._checkpointed_seq else None
            except OSError as exc:
                self._failure = f"audit checkpoints in {self.directory} are not writable: {exc.strerror or exc}"
            except (ValueError, KeyError) as exc:
                self._failure = f"audit log {self.directory} cannot be read back: {exc}"
            self._failed_at = time.monotonic()
            self.write_failures += 1
            raise AuditUnavailable(self._failure)

    def _sign_head(self) -> dict[str, int | str]:
        """Append a signed statement of the head (the lock held, the head current)."""
        statement: dict[str, int | str] = {"seq": self._seq, "head": self._head, "time": _now(), "key_id": self._key_id}
        signed = {**statement, "signature": self._signer.sign(canonical(statement)).hex()}
        path = self.directory / CHECKPOINTS
        if path.exists():
            _last_line(path, cut_torn=True)  # a checkpoint torn by an earlier failure goes first
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab") as handle:
            handle.write(canonical(signed) + b"\n")
            handle.flush()
            os.fsync(handle.fileno())
        self._checkpointed_seq, self._checkpointed_at = self._seq, time.monotonic()
        return signed


def _last_line(path: Path, *, cut_torn: bool) -> bytes | None:
    """The last complete line of a file, read from its end (log files are large); with
    `cut_torn`, a trailing partial line is truncated away (durably) first, else it is an error."""
    with path.open("r+b" if cut_torn else "rb") as handle:
        end = handle.seek(0, os.SEEK_END)
        tail, position = b"", end
        while position > 0:
            position = max(0, position - TAIL_CHUNK)
            handle.seek(position)
            tail = handle.read(min(TAIL_CHUNK, end - position)) + tail
            if tail.count(b"\n") >= 2:  # the last complete line lies whole inside the tail
                break
        if tail and not tail.endswith(b"\n"):
            if not cut_torn:
                raise ValueError(f"{path.name} ends in a partial line")
            keep = position + tail.rfind(b"\n") + 1
            handle.truncate(keep)
            os.fsync(handle.fileno())
            tail = tail[: keep - position]
        lines = tail.splitlines()
        return lines[-1] if lines else None
