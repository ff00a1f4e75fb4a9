"""A window of the audit log for an auditor to check offline with the public key alone: the
records of a time range as stored (with `prev_hash` and `hash`), then the signed checkpoints that
fall in it. It always ends at a checkpoint's record, so a record cut off its end is noticed: the
window reaches past `--until` to the first checkpoint at or after its last record.

File layout (JSON lines): records in sequence order, then checkpoints (the lines with a
`signature`), each exactly as the log holds it: canonical JSON (audit.records.canonical), which
verification requires, so that no reader sees a record other than the one whose hash was checked.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from audit.reader import read_records
from audit.records import canonical
from audit.times import record_instant
from audit.verify import AuditVerificationError, check_checkpoint, check_record, parse_line
from audit.writer import CHECKPOINTS, complete_lines


@dataclass(frozen=True)
class Window:
    """What `select` found: the records (from `since`, through the covering checkpoint) and the
    checkpoints among them; `cover` is None when no checkpoint yet vouches for the last record."""

    records: list[dict[str, Any]]
    checkpoints: list[bytes]
    cover: int | None
    asked: int  # how many records fell between `since` and `until`

    def lines(self) -> Iterator[bytes]:
        """The window file's lines, each ending in a newline."""
        for record in self.records:
            yield canonical(record) + b"\n"
        for checkpoint in self.checkpoints:
            yield checkpoint + b"\n"


@dataclass(frozen=True)
class VerifiedWindow:
    first_seq: int
    last_seq: int
    checkpoints: int
    head: str


def select(directory: Path, since: datetime | None, until: datetime | None) -> Window:
    """The records written from `since` to before `until`, extended to the first checkpoint at or
    after the last of them, and the checkpoints in that span."""
    records = list(read_records(directory, since=since, until=until))
    if not records:
        return Window(records=[], checkpoints=[], cover=None, asked=0)
    asked, last = len(records), records[-1]["seq"]
    checkpoints = _checkpoints(directory)
    cover = next((seq for seq, _ in checkpoints if seq >= last), None)
    if cover is not None and cover > last:
        later = read_records(directory, since=record_instant(records[-1]))
        records += [record for record in later if last < record["seq"] <= cover]
    end = cover if cover is not None else last
    kept = [raw for seq, raw in checkpoints if records[0]["seq"] <= seq <= end]
    return Window(records=records, checkpoints=kept, cover=cover, asked=asked)


def _checkpoints(directory: Path) -> list[tuple[int, bytes]]:
    path = directory / CHECKPOINTS
    lines = complete_lines(path.read_bytes()) if path.exists() else []
    return [(int(json.loads(raw)["seq"]), raw) for raw in lines]


def verify_window(path: Path, public_key: Ed25519PublicKey) -> VerifiedWindow:
    """Check an exported window; raise AuditVerificationError naming the line, the record's seq
    and what failed, at the first fault."""
    records: list[tuple[str, dict[str, Any]]] = []
    checkpoints: list[tuple[str, bytes]] = []
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        where = f"{path.name}:{number}"
        line = parse_line(raw, where)
        if raw != canonical(line):  # as exported: a key given twice, or spacing, would read differently elsewhere
            raise AuditVerificationError(where, "not a line as exported (canonical JSON, each key once): "
                                                "another reader could see a different record")
        if "signature" in line:
            checkpoints.append((where, raw))
        elif checkpoints:
            raise AuditVerificationError(where, "a record after the checkpoints: the window was rearranged")
        else:
            records.append((where, line))
    if not records:
        raise AuditVerificationError(path.name, "no records: not an exported window")
    # 1. Records: each hash recomputes, each links to the one before (the first links to a record
    #    outside the window, which only the checkpoints' signatures vouch for).
    hashes: dict[int, str] = {}
    after: tuple[int, str] | None = None
    last_where = ""
    for where, record in records:
        last_where = check_record(record, where, after)
        after = record["seq"], record["hash"]
        hashes[record["seq"]] = record["hash"]
    assert after is not None
    first, (last, head) = records[0][1]["seq"], after
    # 2. Checkpoints: signed by the key, each naming the hash of a record in the window.
    covered = False
    for where, raw in checkpoints:
        checkpoint = check_checkpoint(raw, where, public_key)
        seq = checkpoint["seq"]
        if seq > last:
            raise AuditVerificationError(
                where, f"missing tail: checkpoint vouches for seq {seq} but the window ends at seq {last}")
        if seq < first:
            raise AuditVerificationError(where, f"checkpoint at seq {seq} is before the window (from seq {first})")
        if hashes[seq] != checkpoint["head"]:
            raise AuditVerificationError(where, f"head mismatch at seq {seq}: the window is not from "
                                                "the log this checkpoint signed")
        covered = covered or seq == last
    # 3. The end: a signed checkpoint names the last record, so none after it can be cut unnoticed.
    if not covered:
        raise AuditVerificationError(last_where, "no signed checkpoint covers the window's last record: "
                                                 "records at its end could have been cut")
    return VerifiedWindow(first_seq=first, last_seq=last, checkpoints=len(checkpoints), head=head)
