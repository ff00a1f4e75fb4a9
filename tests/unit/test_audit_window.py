"""Exported windows of the audit log: a real log written by the real writer, windows exported
from it verify offline with the public key alone, and each kind of tampering is refused naming
the record and what failed."""

from __future__ import annotations

import csv
import io
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from typer.testing import CliRunner

from appliance import cli
from appliance.home import HOME_ENV, Home
from audit import AuditVerificationError, AuditWriter, public_pem, signing_key
from audit.records import digest
from audit.window import select, verify_window
from audit.writer import CHECKPOINTS
from tests.support.audit import event

KEY = Ed25519PrivateKey.generate()
START = datetime(2026, 11, 1, 10, tzinfo=UTC)


def at(second: int) -> datetime:
    return START.replace(second=second)


def write_log(directory: Path, monkeypatch: pytest.MonkeyPatch, key: Ed25519PrivateKey = KEY,
              count: int = 12, prefix: str = "r") -> None:
    """`count` records, one a second from START (seq n+1 at second n), a checkpoint every 5."""
    now = [""]  # records and the checkpoints after them take the time of their second
    with monkeypatch.context() as patched:
        patched.setattr("audit.writer._now", lambda: now[0])
        writer = AuditWriter(directory, key, checkpoint_every=5)
        try:
            for n in range(count):
                now[0] = f"2026-11-01T10:00:{n:02d}.000000Z"
                writer.append(event(n, request_id=f"{prefix}{n}"))
        finally:
            writer.close()


@pytest.fixture
def log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    write_log(tmp_path / "audit", monkeypatch)
    return tmp_path / "audit"


def exported(log: Path, tmp_path: Path, since: int, until: int, name: str = "window.jsonl") -> Path:
    path = tmp_path / name
    path.write_bytes(b"".join(select(log, at(since), at(until)).lines()))
    return path


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def rewrite(path: Path, change: Any) -> None:
    """Replace the window's lines with what `change` makes of them (a list of dicts)."""
    changed = change(lines(path))
    path.write_bytes(b"".join(json.dumps(line, sort_keys=True, separators=(",", ":")).encode() + b"\n"
                              for line in changed))


def test_a_window_reaches_its_covering_checkpoint_and_verifies(log: Path, tmp_path: Path) -> None:
    window = exported(log, tmp_path, since=3, until=7)  # seq 4 to 7, covered by the checkpoint at seq 10
    records = [line for line in lines(window) if "signature" not in line]
    assert [record["seq"] for record in records] == list(range(4, 11))
    assert records[0]["prev_hash"] != "0" * 64 and all("hash" in record for record in records)
    assert [line["seq"] for line in lines(window) if "signature" in line] == [5, 10]
    verified = verify_window(window, KEY.public_key())
    assert (verified.first_seq, verified.last_seq, verified.checkpoints) == (4, 10, 2)
    assert verified.head == records[-1]["hash"]


def test_a_window_that_ends_at_a_checkpoint_is_not_extended(log: Path, tmp_path: Path) -> None:
    window = exported(log, tmp_path, since=5, until=10)  # seq 6 to 10
    assert [line["seq"] for line in lines(window)] == [6, 7, 8, 9, 10, 10]
    assert verify_window(window, KEY.public_key()).last_seq == 10


def test_records_are_written_as_stored(log: Path, tmp_path: Path) -> None:
    stored = (log / "audit-000001.jsonl").read_bytes().splitlines()
    assert exported(log, tmp_path, since=0, until=10).read_bytes().splitlines()[:10] == stored[:10]


def test_past_the_last_checkpoint_there_is_nothing_to_cover(log: Path) -> None:
    window = select(log, at(8), None)
    assert window.cover is None and [record["seq"] for record in window.records] == [9, 10, 11, 12]


@pytest.mark.parametrize(("change", "says"), [
    (lambda ls: [{**line, "status": 500} if line.get("seq") == 6 and "signature" not in line else line
                 for line in ls], r"window.jsonl:3 \(seq 6\): hash mismatch"),
    (lambda ls: ls[:2] + ls[3:], r"window.jsonl:3 \(seq 7\): gap in sequence: expected 6"),
    (lambda ls: [ls[0], ls[2], ls[1], *ls[3:]], r"window.jsonl:2 \(seq 6\): gap in sequence: expected 5"),
    # the end cut past the last checkpoint, which is kept: it names a record no longer there
    (lambda ls: ls[:4] + ls[-2:], r"window.jsonl:6: missing tail: checkpoint vouches for seq 10 but the "
                                  r"window ends at seq 7"),
    # the end cut with its checkpoint: the last record left is signed by none
    (lambda ls: ls[:4] + ls[-2:-1], r"window.jsonl:4 \(seq 7\): no signed checkpoint covers the window's "
                                    r"last record"),
    (lambda ls: [*ls[:-1], {**ls[-1], "signature": "00" * 64}], r"window.jsonl:9: signature failure"),
    (lambda ls: [*ls[:-1], {**ls[-1], "seq": 9}], r"window.jsonl:9: signature failure"),
    (lambda ls: [ls[0], ls[-1], *ls[1:-1]], r"window.jsonl:3: a record after the checkpoints"),
    (lambda ls: [], r"window.jsonl: no records"),
])
def test_tampering_is_refused_naming_the_record(log: Path, tmp_path: Path, change: Any, says: str) -> None:
    window = exported(log, tmp_path, since=3, until=7)  # lines 1-7: seq 4-10; 8, 9: checkpoints 5, 10
    rewrite(window, change)
    with pytest.raises(AuditVerificationError, match=says):
        verify_window(window, KEY.public_key())


@pytest.mark.parametrize("recast", [
    # its first key given twice: Python's json keeps the last (the real value), a first-wins reader the forged
    lambda raw: b'{"%s":"forged",' % next(iter(json.loads(raw))).encode() + raw[1:],
    lambda raw: json.dumps(json.loads(raw), sort_keys=True).encode(),  # the same data, spaced
    lambda raw: json.dumps(dict(reversed(json.loads(raw).items())), separators=(",", ":")).encode(),  # unsorted
])
def test_a_line_not_as_exported_is_refused_though_it_parses_to_the_same(log: Path, tmp_path: Path,
                                                                       recast: Any) -> None:
    window = exported(log, tmp_path, since=3, until=7)
    raw = window.read_bytes().splitlines()
    for index in (2, len(raw) - 1):  # a record (seq 6) and a checkpoint
        changed = [*raw[:index], recast(raw[index]), *raw[index + 1:]]
        assert json.loads(changed[index]) == json.loads(raw[index])
        window.write_bytes(b"".join(line + b"\n" for line in changed))
        with pytest.raises(AuditVerificationError, match=rf"window.jsonl:{index + 1}: not a line as exported"):
            verify_window(window, KEY.public_key())


def test_a_rehashed_record_breaks_the_chain(log: Path, tmp_path: Path) -> None:
    window = exported(log, tmp_path, since=3, until=7)

    def rehashed(ls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        changed = {**ls[1], "status": 500}
        return [ls[0], {**changed, "hash": digest(changed)}, *ls[2:]]

    rewrite(window, rehashed)
    with pytest.raises(AuditVerificationError, match=r"window.jsonl:3 \(seq 6\): chain broken"):
        verify_window(window, KEY.public_key())


def test_the_wrong_public_key_is_refused(log: Path, tmp_path: Path) -> None:
    window = exported(log, tmp_path, since=3, until=7)
    with pytest.raises(AuditVerificationError, match=r"window.jsonl:8: signature failure: not signed by this key"):
        verify_window(window, Ed25519PrivateKey.generate().public_key())


def test_a_window_from_another_log_is_refused(log: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    other = tmp_path / "other"
    write_log(other, monkeypatch, prefix="x")  # same key, same times, other requests
    ours = lines(exported(log, tmp_path, since=3, until=7))
    theirs = exported(other, tmp_path, since=3, until=7, name="theirs.jsonl")
    assert verify_window(theirs, KEY.public_key()).last_seq == 10  # whole, it is a window of its own log
    # its records with our checkpoints: signed, but not over these records
    rewrite(theirs, lambda ls: [*ls[:-2], *ours[-2:]])
    with pytest.raises(AuditVerificationError, match=r"theirs.jsonl:8: head mismatch at seq 5"):
        verify_window(theirs, KEY.public_key())


def test_a_spliced_record_from_another_log_is_refused(log: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    other = tmp_path / "other"
    write_log(other, monkeypatch, prefix="x")
    spliced = lines(exported(other, tmp_path, since=3, until=7, name="theirs.jsonl"))[2]  # seq 6
    window = exported(log, tmp_path, since=3, until=7)
    rewrite(window, lambda ls: [*ls[:2], spliced, *ls[3:]])
    with pytest.raises(AuditVerificationError, match=r"window.jsonl:3 \(seq 6\): chain broken"):
        verify_window(window, KEY.public_key())


# -- the CLI -----------------------------------------------------------------------------------


def appliance(home: Home, *args: str) -> Any:
    return CliRunner().invoke(cli.app, list(args), env={HOME_ENV: str(home.root)})


def test_export_and_verify_a_window_with_the_public_key_alone(home: Home, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    write_log(home.audit, monkeypatch, key=signing_key(home))
    exported = appliance(home, "audit", "export", "--window", "--since", "2026-11-01T10:00:03Z",
                         "--until", "2026-11-01T10:00:07Z")
    assert exported.exit_code == 0, exported.output
    window, pem = tmp_path / "w.jsonl", tmp_path / "auditor.pem"
    window.write_text(exported.output)
    pem.write_bytes(public_pem(signing_key(home)))
    checked = appliance(home, "audit", "verify", "--window", str(window), "--public-key", str(pem))
    assert checked.exit_code == 0, checked.output
    assert "audit window OK" in checked.output and "seq 4 to 10" in checked.output


def test_a_window_past_the_last_checkpoint_gets_one_signed(home: Home, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    write_log(home.audit, monkeypatch, key=signing_key(home))  # checkpoints at 5 and 10; 11, 12 not yet
    exported = appliance(home, "audit", "export", "--window", "--since", "2026-11-01T10:00:08Z")
    assert exported.exit_code == 0, exported.output
    window = tmp_path / "w.jsonl"
    window.write_text(exported.output)
    assert [line["seq"] for line in lines(window) if "signature" in line] == [10, 12]
    assert verify_window(window, signing_key(home).public_key()).last_seq == 12
    assert json.loads((home.audit / CHECKPOINTS).read_bytes().splitlines()[-1])["seq"] == 12


def test_a_tampered_window_fails_the_command_naming_the_record(home: Home, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    write_log(home.audit, monkeypatch, key=signing_key(home))
    window = tmp_path / "w.jsonl"
    window.write_bytes(b"".join(select(home.audit, at(3), at(7)).lines()))
    rewrite(window, lambda ls: ls[:2] + ls[3:])
    failed = appliance(home, "audit", "verify", "--window", str(window))
    assert failed.exit_code == 1
    assert "FAILED verification at w.jsonl:3 (seq 7): gap in sequence: expected 6" in failed.exception.message


def test_a_filtered_window_is_refused(home: Home) -> None:
    refused = appliance(home, "audit", "export", "--window", "--user", "alice")
    assert refused.exit_code == 1 and "--window takes --since and --until only" in refused.exception.message


def test_the_csv_export_has_the_hashes(home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    write_log(home.audit, monkeypatch, count=3)
    shown = appliance(home, "audit", "export", "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(shown.output)))
    assert [row["seq"] for row in rows] == ["1", "2", "3"]
    assert rows[0]["prev_hash"] == "0" * 64 and rows[1]["prev_hash"] == rows[0]["hash"]
