"""Reading the audit log back: records in order or newest first, filtered by time and user.

Both directions read only what they must: newest first reads the files from their ends backwards
and stops at `since`; oldest first skips every file whose last record is before `since`. A
caller that stops after a page (`itertools.islice`) reads about a page, not the whole log.
"""

from __future__ import annotations

import json
import os
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

from audit.writer import complete_lines, log_files

BLOCK = 1 << 16


def read_records(directory: Path, *, since: str | None = None, until: str | None = None,
                 user: str | None = None, newest_first: bool = False) -> Iterator[dict[str, Any]]:
    """Records in sequence order (or newest first); `since` inclusive and `until` exclusive (UTC
    ISO 8601)."""
    lines = _backwards(directory) if newest_first else _forwards(directory, since)
    for raw in lines:
        record = json.loads(raw)
        if since is not None and record["time"] < since:
            if newest_first:
                return  # everything further back is older still
            continue
        if until is not None and record["time"] >= until:
            if not newest_first:
                return
            continue
        if user is not None and record.get("username") != user:
            continue
        yield record


def _forwards(directory: Path, since: str | None) -> Iterator[bytes]:
    files = log_files(directory)
    for path in files:
        if since is not None and path != files[-1]:
            last = _lines_backwards(path)
            newest = next(last, None)
            last.close()
            if newest is not None and json.loads(newest)["time"] < since:
                continue  # a closed file wholly before `since`
        data = path.read_bytes()
        yield from complete_lines(data) if path == files[-1] else data.splitlines()


def _backwards(directory: Path) -> Iterator[bytes]:
    for path in reversed(log_files(directory)):
        yield from _lines_backwards(path)


def _lines_backwards(path: Path) -> Generator[bytes, None, None]:
    """The complete lines of a file, last first, read in blocks from its end (a line still being
    written, after the last newline, is left out)."""
    with path.open("rb") as handle:
        position = handle.seek(0, os.SEEK_END)
        carry: bytes | None = None  # None until the last newline is found; then a line's end
        while position > 0:
            size = min(BLOCK, position)
            position -= size
            handle.seek(position)
            block = handle.read(size)
            if carry is None:
                cut = block.rfind(b"\n")
                if cut < 0:
                    continue  # all of it is still being written
                block, carry = block[:cut], b""
            parts = (block + carry).split(b"\n")
            carry = parts.pop(0)  # may begin in the block before
            for line in reversed(parts):
                if line:
                    yield line
        if carry:
            yield carry
