"""Reading the audit log back: records in order or newest first, filtered by time (as instants),
user, action, outcome and the object acted on.

Both directions read only what they must: newest first reads the files from their ends backwards
and stops at `since`; oldest first skips every file whose last record is before `since`. A
caller that stops after a page (`itertools.islice`) reads about a page, not the whole log.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, get_args

from appliance.errors import Invalid
from audit.records import AuditEvent
from audit.times import parse_instant, record_instant
from audit.writer import complete_lines, log_files

BLOCK = 1 << 16
OUTCOMES: tuple[str, ...] = get_args(AuditEvent.model_fields["outcome"].annotation)  # those records can have
OBJECT_FORMS = "KIND:NAME (user:alice, adapter:support-bot, batch:b-1:7) or NAME (of any kind)"
_KIND = re.compile(r"[a-z][a-z0-9_-]*")


@dataclass(frozen=True)
class ObjectFilter:
    """Records whose `target` has this name (and this kind, if given). Records written before
    targets were recorded have none, and match no object filter."""

    name: str
    kind: str | None = None

    @classmethod
    def parse(cls, text: str, *, option: str) -> ObjectFilter:
        """`KIND:NAME` or `NAME`; the first colon ends the kind, so a name holding a colon needs
        its kind. Raises Invalid naming `option` for an empty name or a kind not a lowercase word."""
        kind, colon, name = text.partition(":")
        if not colon:
            kind, name = "", text
        if not name or (colon and not _KIND.fullmatch(kind)):
            raise Invalid(f"{option} {text!r} is not an object: use {OBJECT_FORMS}")
        return cls(name=name, kind=kind or None)

    def matches(self, target: object) -> bool:
        return (isinstance(target, dict) and target.get("name") == self.name
                and (self.kind is None or target.get("kind") == self.kind))


@dataclass(frozen=True)
class RecordFilter:
    """What a record must be to be read back; None matches anything."""

    user: str | None = None
    action: str | None = None
    outcome: str | None = None
    target: ObjectFilter | None = None

    def matches(self, record: dict[str, Any]) -> bool:
        return ((self.user is None or record.get("username") == self.user)
                and (self.action is None or record.get("action") == self.action)
                and (self.outcome is None or record.get("outcome") == self.outcome)
                and (self.target is None or self.target.matches(record.get("target"))))


def parse_outcome(text: str, *, option: str) -> str:
    """`text` if it is an outcome records can have; Invalid naming `option` otherwise."""
    if text not in OUTCOMES:
        raise Invalid(f"{option} {text!r} is not an outcome: use one of {', '.join(OUTCOMES)}")
    return text


def read_records(directory: Path, *, since: datetime | str | None = None, until: datetime | str | None = None,
                 where: RecordFilter | None = None, newest_first: bool = False) -> Iterator[dict[str, Any]]:
    """Records in sequence order (or newest first) written at or after `since` and before `until`
    (instants; text is parsed as `appliance audit export --since` takes it) that match `where`."""
    start, end = _instant(since, "since"), _instant(until, "until")
    lines = _backwards(directory) if newest_first else _forwards(directory, start)
    for raw in lines:
        record = json.loads(raw)
        side = _side(record, start, end)
        if (side < 0 and newest_first) or (side > 0 and not newest_first):
            return  # every record further on is further outside
        if not side and (where is None or where.matches(record)):
            yield record


def _side(record: dict[str, Any], start: datetime | None, end: datetime | None) -> int:
    """-1 before `start`, 1 at or after `end`, 0 between (the time is read only if there is a bound)."""
    if start is None and end is None:
        return 0
    written = record_instant(record)
    if start is not None and written < start:
        return -1
    return 1 if end is not None and written >= end else 0


def _instant(value: datetime | str | None, name: str) -> datetime | None:
    return parse_instant(value, name=name) if isinstance(value, str) else value


def _forwards(directory: Path, since: datetime | None) -> Iterator[bytes]:
    files = log_files(directory)
    for path in files:
        if since is not None and path != files[-1]:
            last = _lines_backwards(path)
            newest = next(last, None)
            last.close()
            if newest is not None and record_instant(json.loads(newest)) < since:
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
