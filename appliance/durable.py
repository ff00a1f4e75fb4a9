"""Replacing a file so that a crash or power loss leaves the old version or the new one, never
an empty or half-written file; and reading back a small one another program wrote, guardedly."""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path
from typing import BinaryIO

PIECE_BYTES = 1 << 20  # a file-like source is copied in pieces of this size, never read whole


def replace_file(path: Path, data: bytes | BinaryIO, *, mode: int = 0o600) -> None:
    """Write `data` (bytes, or a binary file read from where it stands to its end) beside `path`,
    flush it to disk, rename it over `path`, flush the directory. The file written first has a
    name of its own, made new (never a file or link already there): two writers at once each
    replace `path` whole, and a link planted under a predictable name is not followed."""
    partial = path.with_name(f".{path.name}.{secrets.token_hex(8)}.partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        pieces = [data] if isinstance(data, bytes) else iter(lambda: data.read(PIECE_BYTES), b"")
        for piece in pieces:
            view = memoryview(piece)
            while view:
                view = view[os.write(fd, view):]
        os.fchmod(fd, mode)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        partial.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(partial, path)
    fsync_directory(path.parent)


def fsync_directory(directory: Path) -> None:
    """Make the names in `directory` (a file created or renamed there) survive a crash too."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_small_file(path: Path, max_bytes: int) -> tuple[bytes, float] | None:
    """A plain file's bytes and when it was written (Unix time); None unless it is a regular file
    of at most `max_bytes` (never a link followed, nor a pipe or device waited on)."""
    try:
        handle = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        found = os.fstat(handle)
        if not stat.S_ISREG(found.st_mode) or found.st_size > max_bytes:
            return None
        return os.read(handle, max_bytes), found.st_mtime
    except OSError:
        return None
    finally:
        os.close(handle)
