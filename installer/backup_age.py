"""A backup file's envelope: an age file (age-encryption.org/v1, through pyrage), so the `age` tool
opens a backup away from the appliance. Its payload is sealed in 64 KiB chunks (ChaCha20-Poly1305,
the STREAM construction: each chunk's place and the end of the file authenticated) and its header
is MACed, so a wrong key, a bit flipped anywhere, a chunk dropped, moved or appended and a file cut
short are refused before anything is restored; what the archive holds is checked by installer.backup.

The key is either a passphrase (age's scrypt recipient: rage picks the work factor that takes about
a second on the sealing host) or an X25519 identity (`age-keygen -o FILE`: the file holds the
`AGE-SECRET-KEY-1...` line; its public key is the recipient). pyrage takes and gives a passphrase
file's payload whole, so a passphrase backup is held in memory while it is sealed or opened; with an
identity it is streamed.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections.abc import Callable
from typing import BinaryIO, cast

import pyrage

from appliance.errors import StateError
from installer.backup_archive import IDENTITY_PREFIX, BackupError

MAGIC = b"age-encryption.org/v1\n"


def _identity(key: bytes) -> pyrage.x25519.Identity | None:
    if not key.startswith(IDENTITY_PREFIX):
        return None
    try:
        return pyrage.x25519.Identity.from_str(key.decode("ascii"))
    except (pyrage.IdentityError, UnicodeDecodeError, ValueError):
        raise BackupError("the backup key file's AGE-SECRET-KEY line is not a valid age identity",
                          hint="make one with `age-keygen -o FILE`") from None


def _passphrase(key: bytes) -> str:
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        raise BackupError("the backup passphrase is not UTF-8 text, which age passphrases are",
                          hint="a key file made with `head -c 32 /dev/urandom | base64 > FILE` is") from None


def _io(stream: BinaryIO) -> io.BufferedIOBase:
    """A file object as pyrage's stubs name it (it calls read, readinto or write on any)."""
    return cast(io.BufferedIOBase, stream)


class _Pumped:
    """Runs `pump(reader, writer)` (a pyrage streaming call) in a thread over a pipe: its writer or
    its reader is ours. The error it ends with, if any, is raised by `join`."""

    def __init__(self, pump: Callable[[BinaryIO, BinaryIO], object], source: BinaryIO | None,
                 sink: BinaryIO | None) -> None:
        read_end, write_end = os.pipe()
        self.ours: BinaryIO = os.fdopen(write_end if source is None else read_end, "wb" if source is None else "rb")
        theirs = os.fdopen(read_end if source is None else write_end, "rb" if source is None else "wb")
        self._error: BaseException | None = None

        def run() -> None:
            try:
                with theirs:
                    if source is None:
                        assert sink is not None
                        pump(theirs, sink)
                    else:
                        pump(source, theirs)
            except BaseException as exc:  # handed to join(), in the caller's thread
                self._error = exc

        self._thread = threading.Thread(target=run, name="backup-age", daemon=True)
        self._thread.start()

    def join(self) -> BaseException | None:
        with contextlib.suppress(OSError):  # a pipe whose other end is gone (the thread's own error says why)
            self.ours.close()
        self._thread.join()
        return self._error


class AgeWriter:
    """A write-only file object: what is written becomes an age file on `out`; `close` ends it."""

    def __init__(self, out: BinaryIO, key: bytes) -> None:
        self._out, self._closed = out, False
        identity = _identity(key)
        self._passphrase = None if identity is not None else _passphrase(key)
        self._buffer = io.BytesIO()
        self._pumped = None
        if identity is not None:
            recipients = [identity.to_public()]
            self._pumped = _Pumped(lambda reader, writer: pyrage.encrypt_io(_io(reader), _io(writer), recipients),
                                   None, out)

    def write(self, data: bytes) -> int:
        if self._pumped is None:
            return self._buffer.write(data)
        try:
            self._pumped.ours.write(data)
        except (BrokenPipeError, ValueError):  # age's thread stopped (and its pipe closed): writing failed
            raise StateError(f"cannot write the backup ({self._pumped.join()})") from None
        return len(data)

    def close(self) -> None:
        """Ends the age file: what was written is sealed whole."""
        if self._closed:
            return
        self._closed = True
        if self._pumped is not None:
            if (error := self._pumped.join()) is not None:
                raise BackupError(f"sealing the backup failed ({error})")
        else:
            assert self._passphrase is not None
            self._out.write(pyrage.passphrase.encrypt(self._buffer.getvalue(), self._passphrase))
            self._buffer = io.BytesIO()

    def abort(self) -> None:
        """Stops, sealing nothing more (the backup failed; its file is the caller's to remove)."""
        if not self._closed:
            self._closed = True
            self._buffer = io.BytesIO()
            if self._pumped is not None:
                self._pumped.join()


def _refusal(error: BaseException, name: str) -> BackupError:
    """What pyrage's error says of the file, for the operator. rage says "Decryption failed" when no
    key in the header opens it (a wrong key, or a damaged header), "decryption error" when a chunk
    does not authenticate (altered, dropped, moved, appended, or the last one cut), and names others."""
    text = str(error).replace("\n", " ")
    if text == "Decryption failed" or "no matching" in text.lower():
        return BackupError(f"{name}: wrong passphrase or key file (or its header is damaged)")
    if text.startswith("Excessive work"):
        return BackupError(f"{name}: its scrypt work factor is far above what this host does now in a second "
                           f"({text}); rage measures the host at each open, so a host busier than the one that "
                           "sealed it refuses it", hint="try again when the host is less loaded, or open it with "
                           "`age -d` (which accepts up to 2^22); an identity key file avoids scrypt altogether")
    if "truncated" in text or "fill whole buffer" in text:
        return BackupError(f"{name} is cut short (age: {text})")
    if text == "decryption error":
        return BackupError(f"{name}: a chunk is damaged or out of place, or the file is cut short (age "
                           "authenticates each chunk, its place and the file's end)")
    return BackupError(f"{name} is damaged: age refuses it ({text})")


class AgeReader:
    """A read-only file object over an age backup. Each chunk is authenticated before any of it is
    returned; `finish` reads to the end and raises unless the file ended where it was sealed to."""

    def __init__(self, source: BinaryIO, key: bytes, name: str) -> None:
        self._name, self._ended = name, False
        identity = _identity(key)
        self._pumped = None
        if identity is None:
            try:
                self._plain: BinaryIO = io.BytesIO(pyrage.passphrase.decrypt(source.read(), _passphrase(key)))
            except pyrage.DecryptError as exc:
                raise _refusal(exc, name) from None
        else:
            self._pumped = _Pumped(lambda reader, writer: pyrage.decrypt_io(_io(reader), _io(writer), [identity]),
                                   source, None)
            self._plain = self._pumped.ours

    def read(self, size: int = -1) -> bytes:
        data = self._plain.read(size)
        self._ended = self._ended or (not data and size != 0)
        return data

    def finish(self) -> None:
        while self.read(1 << 20):
            pass
        self.close()

    def close(self) -> None:
        """Raises what age refused the file for, once the payload ended (age ends it early when a
        chunk does not authenticate); stopping before then ends age's thread, whose writes then
        fail on the closed pipe: that is not the file's fault, and not raised."""
        if self._pumped is not None:
            pumped, self._pumped = self._pumped, None
            if (error := pumped.join()) is not None and self._ended:
                raise _refusal(error, self._name)
