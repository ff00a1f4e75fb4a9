"""Verify an audit log: every record's hash, the chain, the sequence, every checkpoint's
signature, and that no records are missing after the last checkpoint. Raises on the first fault,
naming the file, line and sequence number and why; returns a summary when all is well.

`check_record` and `check_checkpoint` are the one place records' hashes and checkpoints'
signatures are checked: the whole log here, an exported window in `audit.window`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from audit.records import GENESIS, canonical, digest
from audit.writer import CHECKPOINTS, complete_lines, log_files


class AuditVerificationError(Exception):
    """The log was altered, reordered, cut or signed by another key."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.where = where
        self.reason = reason


@dataclass(frozen=True)
class Verified:
    records: int
    files: int
    checkpoints: int
    head: str
    last_checkpoint_seq: int


def parse_line(raw: bytes, where: str) -> dict[str, Any]:
    """One JSON object of a log or window line; AuditVerificationError naming `where` otherwise."""
    try:
        parsed = json.loads(raw)
    except ValueError:
        raise AuditVerificationError(where, "not a JSON record") from None
    if not isinstance(parsed, dict):
        raise AuditVerificationError(where, "not an audit record")
    return parsed


def check_record(record: dict[str, Any], where: str, after: tuple[int, str] | None) -> str:
    """Check a record against the one before it, `after` (its seq and hash; None at the start of a
    window, where nothing comes before). Returns `where` with the record's seq; raises
    AuditVerificationError naming it and what failed."""
    if "hash" not in record:
        raise AuditVerificationError(where, "not an audit record")
    where += f" (seq {record.get('seq')})"
    if not isinstance(record.get("seq"), int) or (after is not None and record["seq"] != after[0] + 1):
        expected = after[0] + 1 if after is not None else "a sequence number"
        raise AuditVerificationError(where, f"gap in sequence: expected {expected}")
    if record["hash"] != digest(record):
        raise AuditVerificationError(where, "hash mismatch: the record was altered")
    if after is not None and record.get("prev_hash") != after[1]:
        raise AuditVerificationError(where, "chain broken: prev_hash is not the previous record's hash")
    return where


def check_checkpoint(raw: bytes, where: str, public_key: Ed25519PublicKey) -> dict[str, Any]:
    """A checkpoint line whose signature `public_key` verifies; AuditVerificationError otherwise."""
    try:
        checkpoint = json.loads(raw)
        statement = {k: checkpoint[k] for k in ("seq", "head", "time", "key_id")}
        public_key.verify(bytes.fromhex(checkpoint["signature"]), canonical(statement))
    except (ValueError, KeyError, TypeError):
        raise AuditVerificationError(where, "not a checkpoint") from None
    except InvalidSignature:
        raise AuditVerificationError(where, "signature failure: not signed by this key") from None
    if not isinstance(checkpoint["seq"], int):
        raise AuditVerificationError(where, "not a checkpoint")
    return dict(checkpoint)


def verify(directory: Path, public_key: Ed25519PublicKey) -> Verified:
    """Walk the log in order; raise AuditVerificationError at the first bad record or checkpoint.

    Safe while a writer appends: checkpoints are read first (each is written after the records it
    vouches for, so those are on disk when the records are read next), and a last line still
    being written (no newline yet) is left for the next verification.
    """
    path = directory / CHECKPOINTS
    lines = complete_lines(path.read_bytes()) if path.exists() else []
    # 1. Records: parse, recompute each hash, follow the chain and the sequence.
    hashes: dict[int, str] = {}
    head, seq = GENESIS, 0
    files = log_files(directory)
    for path in files:
        data = path.read_bytes()
        for number, raw in enumerate(complete_lines(data) if path == files[-1] else data.splitlines(), start=1):
            where = f"{path.name}:{number}"
            record = parse_line(raw, where)
            check_record(record, where, (seq, head))
            seq, head = record["seq"], record["hash"]
            hashes[seq] = head
    # 2. Checkpoints: signed by the key, naming a head that is in the chain, in order.
    count, last = 0, 0
    for number, raw in enumerate(lines, start=1):
        where = f"{CHECKPOINTS}:{number}"
        checkpoint = check_checkpoint(raw, where, public_key)
        if checkpoint["seq"] < last:
            raise AuditVerificationError(where, "checkpoints out of order")
        if checkpoint["seq"] > seq:
            raise AuditVerificationError(
                where, f"missing tail: checkpoint vouches for seq {checkpoint['seq']} but the log "
                       f"ends at seq {seq}")
        if hashes.get(checkpoint["seq"]) != checkpoint["head"]:
            raise AuditVerificationError(where, f"head mismatch at seq {checkpoint['seq']}")
        count, last = count + 1, checkpoint["seq"]
    return Verified(records=seq, files=len(files), checkpoints=count, head=head, last_checkpoint_seq=last)
