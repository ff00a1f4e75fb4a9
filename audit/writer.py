"""The append-only audit log: hash-chained records, durable before `append` returns, with fsyncs
shared by concurrent writers (group commit), size-based rotation that keeps the chain, and
Ed25519-signed checkpoints every N records or T seconds.

Layout of the log directory:
    audit-000001.jsonl, audit-000002.jsonl, ...   records, one canonical JSON line each
    checkpoints.jsonl                             signed (seq, head hash, time) statements
"""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from audit.keys import key_id
from audit.records import GENESIS, AuditEvent, AuditRecord, canonical, digest

CHECKPOINTS = "checkpoints.jsonl"
RETRY_AFTER_S = 2.0


class AuditUnavailable(Exception):
    """The log cannot be written: callers must fail closed."""


def log_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("audit-*.jsonl"))


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


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
        self._pending: list[AuditRecord] = []
        self._flushing = False
        self._failure: str | None = None
        self._failed_at = 0.0
        # Records name users and what they did: private to the appliance, like its secrets.
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
        self._recover()

    # -- state ------------------------------------------------------------------------------

    def _recover(self) -> None:
        """Find the chain head on disk. A torn last line (crash mid-write) was never acknowledged,
        so it is cut off; anything else unreadable stops the writer (verify will say why)."""
        self._seq, self._head = 0, GENESIS
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
        self._fd: int | None = None
        self._size = 0
        files = log_files(self.directory)
        self._file = files[-1] if files else self.directory / "audit-000001.jsonl"
        if files:
            data = self._file.read_bytes()
            if data and not data.endswith(b"\n"):
                cut = data.rfind(b"\n") + 1
                with self._file.open("r+b") as handle:
                    handle.truncate(cut)
                    os.fsync(handle.fileno())
                data = data[:cut]
            lines = data.splitlines()
            if not lines and len(files) > 1:
                lines = files[-2].read_bytes().splitlines()
            if lines:
                last = json.loads(lines[-1])
                self._seq, self._head = int(last["seq"]), str(last["hash"])
        self._durable_seq, self._durable_head = self._seq, self._head
        self._checkpointed_seq, self._checkpointed_at = self._last_checkpoint()

    def _last_checkpoint(self) -> tuple[int, float]:
        path = self.directory / CHECKPOINTS
        if not path.exists():
            return 0, time.monotonic()
        lines = path.read_bytes().splitlines()
        return (int(json.loads(lines[-1])["seq"]) if lines else 0), time.monotonic()

    @property
    def failure(self) -> str | None:
        """Why the log is not writable, or None (see `check` to also retry)."""
        return self._failure

    def check(self) -> str | None:
        """Why the log is not writable, or None; after a failure, retries now and then."""
        with self._cond:
            self._retry_after_failure()
            return self._failure

    @property
    def head(self) -> tuple[int, str]:
        """(last durable sequence number, its hash)."""
        with self._cond:
            return self._durable_seq, self._durable_head

    # -- appending --------------------------------------------------------------------------

    def append(self, event: AuditEvent) -> AuditRecord:
        """Chain, write and fsync `event`; raise AuditUnavailable if it cannot be made durable."""
        with self._cond:
            self._retry_after_failure()
            if self._failure is not None:
                raise AuditUnavailable(self._failure)
            fields = {**event.model_dump(), "seq": self._seq + 1, "time": _now(), "prev_hash": self._head}
            record = AuditRecord(**fields, hash=digest(fields))
            self._seq, self._head = record.seq, record.hash
            self._pending.append(record)
            while self._durable_seq < record.seq:
                if self._failure is not None:
                    raise AuditUnavailable(self._failure)
                if self._flushing:
                    self._cond.wait()
                    continue
                self._flushing = True
                batch, self._pending = self._pending, []
                self._cond.release()
                try:
                    self._write(batch)
                    failure = None
                except OSError as exc:
                    failure = f"audit log {self.directory} is not writable: {exc.strerror or exc}"
                finally:
                    self._cond.acquire()
                    self._flushing = False
                if failure is not None:
                    self._failure, self._failed_at = failure, time.monotonic()
                else:
                    self._durable_seq, self._durable_head = batch[-1].seq, batch[-1].hash
                self._cond.notify_all()
            self._maybe_checkpoint()
        return record

    def _retry_after_failure(self) -> None:
        """Once in a while after a failure (disk full, say), re-read the head from disk and try
        again: records that never reached the disk were never acknowledged."""
        if self._failure is None or self._flushing or time.monotonic() - self._failed_at < RETRY_AFTER_S:
            return
        try:
            self._recover()
        except (OSError, ValueError, KeyError) as exc:
            self._failed_at = time.monotonic()
            self._failure = f"audit log {self.directory} cannot be reopened: {exc}"
            return
        self._pending = []
        self._failure = None

    def _write(self, batch: list[AuditRecord]) -> None:
        """Append a batch with one write and one fsync (only the flushing thread gets here)."""
        if self._fd is not None and self._size >= self._max_bytes:
            os.close(self._fd)
            self._fd = None
            number = int(self._file.stem.split("-")[1]) + 1
            self._file = self.directory / f"audit-{number:06d}.jsonl"
        if self._fd is None:
            new = not self._file.exists()
            self._fd = os.open(self._file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            self._size = os.fstat(self._fd).st_size
            if new:
                _fsync_dir(self.directory)
        data = b"".join(record.line() for record in batch)
        try:
            written = os.write(self._fd, data)
            while written < len(data):
                written += os.write(self._fd, data[written:])
            os.fsync(self._fd)
        except OSError:
            os.close(self._fd)  # reopened (and the torn tail cut) by the next recovery
            self._fd = None
            raise
        self._size += len(data)

    def close(self) -> None:
        """Release the open log file (the writer reopens it if used again)."""
        with self._cond:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    # -- checkpoints ------------------------------------------------------------------------

    def _maybe_checkpoint(self) -> None:
        due = (self._durable_seq - self._checkpointed_seq >= self._every
               or time.monotonic() - self._checkpointed_at >= self._interval)
        if due and self._durable_seq > self._checkpointed_seq and not self._pending:
            self._checkpoint_locked()

    def checkpoint(self) -> dict | None:
        """Sign the current head now (also called on a timer); None if nothing new."""
        with self._cond:
            if self._failure is not None or self._durable_seq == self._checkpointed_seq:
                return None
            while self._flushing or self._pending:
                self._cond.wait()
            return self._checkpoint_locked()

    def _checkpoint_locked(self) -> dict:
        statement = {"seq": self._durable_seq, "head": self._durable_head, "time": _now(),
                     "key_id": self._key_id}
        signed = {**statement, "signature": self._signer.sign(canonical(statement)).hex()}
        try:
            path = self.directory / CHECKPOINTS
            with os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab") as handle:
                handle.write(canonical(signed) + b"\n")
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as exc:
            self._failure = f"audit checkpoints in {self.directory} are not writable: {exc.strerror or exc}"
            raise AuditUnavailable(self._failure) from exc
        self._checkpointed_seq, self._checkpointed_at = self._durable_seq, time.monotonic()
        return signed


def _fsync_dir(directory: Path) -> None:
    """Make a new file's directory entry durable too."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
