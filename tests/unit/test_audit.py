"""The audit log: chain, durability, group commit, rotation, checkpoints, and verification that
names the first bad record for each kind of tampering."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from appliance.changes import Target
from audit import AuditEvent, AuditUnavailable, AuditVerificationError, AuditWriter, read_records, verify
from audit.reader import ObjectFilter, RecordFilter
from audit.writer import CHECKPOINTS, log_files
from tests.support.audit import event

KEY = Ed25519PrivateKey.generate()


def filled(tmp_path: Path, count: int = 10, **kwargs: object) -> AuditWriter:
    writer = AuditWriter(tmp_path, KEY, **kwargs)
    for n in range(count):
        writer.append(event(n))
    writer.checkpoint()
    return writer


def rewrite_line(path: Path, index: int, change) -> None:
    lines = path.read_bytes().splitlines()
    record = json.loads(lines[index])
    change(record)
    lines[index] = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
    path.write_bytes(b"\n".join(lines) + b"\n")


def test_records_chain_and_verify(tmp_path: Path) -> None:
    writer = filled(tmp_path, 10)
    summary = verify(tmp_path, KEY.public_key())
    assert summary.records == 10 and summary.checkpoints == 1 and summary.last_checkpoint_seq == 10
    assert writer.head == (10, summary.head)
    assert log_files(tmp_path)[0].stat().st_mode & 0o777 == 0o600
    assert (tmp_path / CHECKPOINTS).stat().st_mode & 0o777 == 0o600
    assert tmp_path.stat().st_mode & 0o777 == 0o700
    first = json.loads(log_files(tmp_path)[0].read_bytes().splitlines()[0])
    assert first["seq"] == 1 and first["prev_hash"] == "0" * 64 and first["time"].endswith("Z")


def test_edit_in_the_middle_is_named(tmp_path: Path) -> None:
    filled(tmp_path)
    path = log_files(tmp_path)[0]
    rewrite_line(path, 4, lambda r: r.update(status=403))
    with pytest.raises(AuditVerificationError, match=r"audit-000001.jsonl:5 \(seq 5\): hash mismatch"):
        verify(tmp_path, KEY.public_key())


def test_rehashed_edit_breaks_the_chain(tmp_path: Path) -> None:
    from audit.records import digest

    filled(tmp_path)
    path = log_files(tmp_path)[0]
    rewrite_line(path, 4, lambda r: r.update(status=403, hash=digest({**r, "status": 403})))
    with pytest.raises(AuditVerificationError, match=r":6 \(seq 6\): chain broken"):
        verify(tmp_path, KEY.public_key())


def test_removed_record_is_a_gap(tmp_path: Path) -> None:
    filled(tmp_path)
    path = log_files(tmp_path)[0]
    lines = path.read_bytes().splitlines()
    path.write_bytes(b"\n".join(lines[:3] + lines[4:]) + b"\n")
    with pytest.raises(AuditVerificationError, match=r":4 \(seq 5\): gap in sequence: expected 4"):
        verify(tmp_path, KEY.public_key())


def test_reordered_records_are_detected(tmp_path: Path) -> None:
    filled(tmp_path)
    path = log_files(tmp_path)[0]
    lines = path.read_bytes().splitlines()
    lines[2], lines[3] = lines[3], lines[2]
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(AuditVerificationError, match="gap in sequence"):
        verify(tmp_path, KEY.public_key())


def test_cut_tail_after_checkpoint_is_detected(tmp_path: Path) -> None:
    filled(tmp_path)
    path = log_files(tmp_path)[0]
    lines = path.read_bytes().splitlines()
    path.write_bytes(b"\n".join(lines[:7]) + b"\n")
    with pytest.raises(AuditVerificationError,
                       match="missing tail: checkpoint vouches for seq 10 but the log ends at seq 7"):
        verify(tmp_path, KEY.public_key())


def test_checkpoint_signed_by_another_key_fails(tmp_path: Path) -> None:
    filled(tmp_path)
    with pytest.raises(AuditVerificationError, match=f"{CHECKPOINTS}:1: signature failure"):
        verify(tmp_path, Ed25519PrivateKey.generate().public_key())


def test_forged_checkpoint_fails(tmp_path: Path) -> None:
    filled(tmp_path)
    path = tmp_path / CHECKPOINTS
    checkpoint = json.loads(path.read_bytes())
    checkpoint["seq"] = 3
    path.write_text(json.dumps(checkpoint) + "\n")
    with pytest.raises(AuditVerificationError, match="signature failure"):
        verify(tmp_path, KEY.public_key())


def test_rotation_keeps_the_chain_and_restart_continues_it(tmp_path: Path) -> None:
    writer = filled(tmp_path, 30, max_file_bytes=2000)
    assert len(log_files(tmp_path)) > 2
    again = AuditWriter(tmp_path, KEY, max_file_bytes=2000)  # a restart picks up the head
    assert again.head == writer.head
    again.append(event(99))
    assert verify(tmp_path, KEY.public_key()).records == 31


def test_torn_last_line_is_cut_on_restart(tmp_path: Path) -> None:
    filled(tmp_path, 5)
    path = log_files(tmp_path)[0]
    with path.open("ab") as handle:
        handle.write(b'{"seq":6,"half')  # a crash mid-write: never acknowledged
    writer = AuditWriter(tmp_path, KEY)
    assert writer.head[0] == 5
    writer.append(event(6))
    assert verify(tmp_path, KEY.public_key()).records == 6


def test_concurrent_writers_share_fsyncs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import audit.writer as module

    fsyncs = []
    real = module.os.fsync
    monkeypatch.setattr(module.os, "fsync", lambda fd: (fsyncs.append(fd), real(fd)))
    writer = AuditWriter(tmp_path, KEY, checkpoint_every=10_000, checkpoint_interval_s=3600)
    threads = [threading.Thread(target=lambda i=i: [writer.append(event(i * 100 + j)) for j in range(25)])
               for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert verify(tmp_path, KEY.public_key()).records == 200
    assert len(fsyncs) < 200, "concurrent appends must share fsyncs"


def test_failure_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writer = filled(tmp_path, 3)

    def disk_full(batch: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer, "_write", disk_full)
    with pytest.raises(AuditUnavailable, match="No space left on device"):
        writer.append(event(4))
    assert writer.failure and "No space left" in writer.failure
    with pytest.raises(AuditUnavailable):
        writer.append(event(5))
    assert verify(tmp_path, KEY.public_key()).records == 3
    # Space returns: after the retry delay the writer reopens the log and goes on.
    monkeypatch.undo()
    monkeypatch.setattr("audit.writer.RETRY_AFTER_S", 0.0)
    record = writer.append(event(6))
    assert record.seq == 4 and writer.failure is None
    assert verify(tmp_path, KEY.public_key()).records == 4


@pytest.fixture(scope="module")
def big_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """10,000 records from 16 concurrent writers, checkpointed every 1000."""
    directory = tmp_path_factory.mktemp("big")
    writer = AuditWriter(directory, KEY, checkpoint_every=1000, max_file_bytes=1 << 20)
    threads = [threading.Thread(target=lambda i=i: [writer.append(event(i * 1000 + j)) for j in range(625)])
               for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    writer.checkpoint()  # as the gateway's timer would
    assert verify(directory, KEY.public_key()).records == 10_000
    return directory


def tampered(big_log: Path, tmp_path: Path) -> tuple[Path, list[Path]]:
    copy = tmp_path / "log"
    shutil.copytree(big_log, copy)
    return copy, log_files(copy)


def test_ten_thousand_concurrent_records_verify(big_log: Path) -> None:
    summary = verify(big_log, KEY.public_key())
    assert summary.records == 10_000 and summary.last_checkpoint_seq == 10_000
    assert summary.checkpoints >= 9 and summary.files > 1


def test_one_byte_changed(big_log: Path, tmp_path: Path) -> None:
    copy, files = tampered(big_log, tmp_path)
    data = bytearray(files[1].read_bytes())
    data[data.index(b'"alice"') + 1] = ord("A")
    files[1].write_bytes(bytes(data))
    with pytest.raises(AuditVerificationError, match=rf"{files[1].name}:\d+ \(seq \d+\): hash mismatch"):
        verify(copy, KEY.public_key())


def test_one_record_deleted(big_log: Path, tmp_path: Path) -> None:
    copy, files = tampered(big_log, tmp_path)
    lines = files[2].read_bytes().splitlines()
    files[2].write_bytes(b"\n".join(lines[:10] + lines[11:]) + b"\n")
    with pytest.raises(AuditVerificationError, match=rf"{files[2].name}:11 .*gap in sequence"):
        verify(copy, KEY.public_key())


def test_two_records_swapped(big_log: Path, tmp_path: Path) -> None:
    copy, files = tampered(big_log, tmp_path)
    lines = files[0].read_bytes().splitlines()
    lines[5], lines[6] = lines[6], lines[5]
    files[0].write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(AuditVerificationError, match=rf"{files[0].name}:6 \(seq 7\): gap in sequence"):
        verify(copy, KEY.public_key())


def test_record_inserted(big_log: Path, tmp_path: Path) -> None:
    from audit.records import AuditRecord, digest

    copy, files = tampered(big_log, tmp_path)
    lines = files[0].read_bytes().splitlines()
    previous = json.loads(lines[4])
    fields = {**event(9999).model_dump(), "seq": previous["seq"] + 1, "time": previous["time"],
              "prev_hash": previous["hash"]}
    forged = AuditRecord(**fields, hash=digest(fields)).line().rstrip(b"\n")
    files[0].write_bytes(b"\n".join(lines[:5] + [forged] + lines[5:]) + b"\n")
    with pytest.raises(AuditVerificationError, match=rf"{files[0].name}:7 \(seq 6\): gap in sequence"):
        verify(copy, KEY.public_key())


def test_tail_truncated_after_checkpoint(big_log: Path, tmp_path: Path) -> None:
    copy, files = tampered(big_log, tmp_path)
    for path in files[-2:]:
        path.unlink()
    with pytest.raises(AuditVerificationError, match="missing tail"):
        verify(copy, KEY.public_key())


def test_forged_checkpoint_signature(big_log: Path, tmp_path: Path) -> None:
    copy, _ = tampered(big_log, tmp_path)
    path = copy / CHECKPOINTS
    lines = path.read_bytes().splitlines()
    checkpoint = json.loads(lines[3])
    checkpoint["signature"] = "00" * 64
    lines[3] = json.dumps(checkpoint).encode()
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(AuditVerificationError, match=f"{CHECKPOINTS}:4: signature failure"):
        verify(copy, KEY.public_key())


@pytest.mark.integration
def test_writers_in_two_processes_share_one_chain(tmp_path: Path) -> None:
    """The gateway and the CLI append to one log: each catches up with the other's records."""
    raw = KEY.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()).hex()
    gateway = AuditWriter(tmp_path, KEY, checkpoint_every=3)
    gateway.append(event(1))
    cli = ("import sys; from pathlib import Path; from audit import AuditEvent, AuditWriter; "
           "from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey as K; "
           "w = AuditWriter(Path(sys.argv[1]), K.from_private_bytes(bytes.fromhex(sys.argv[2]))); "
           "[w.append(AuditEvent(request_id=f'cli{n}', action='model.prepare', outcome='allowed', "
           "status=0)) for n in range(2)]")
    subprocess.run([sys.executable, "-c", cli, str(tmp_path), raw], check=True)
    record = gateway.append(event(2))
    assert record.seq == 4, "the gateway chains onto the CLI's records"
    assert verify(tmp_path, KEY.public_key()).records == 4


def test_writer_objects_interleaving_on_one_directory_keep_the_chain(tmp_path: Path) -> None:
    first, second = (AuditWriter(tmp_path, KEY, checkpoint_every=50, max_file_bytes=20_000) for _ in range(2))
    threads = [threading.Thread(target=lambda w=w, i=i: [w.append(event(i * 100 + j)) for j in range(60)])
               for i, w in enumerate([first, second] * 3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    second.checkpoint()
    summary = verify(tmp_path, KEY.public_key())
    assert summary.records == 360 and summary.files > 1 and summary.last_checkpoint_seq == 360


def test_a_writer_notices_another_rotated_past_the_file_it_last_wrote(tmp_path: Path) -> None:
    """The other writer rotated before writing, so the old file's size is what this writer left:
    only the new file's existence tells it the head moved."""
    first, second = (AuditWriter(tmp_path, KEY, max_file_bytes=100) for _ in range(2))
    first.append(event(1))  # one record fills the file past 100 bytes
    second.append(event(2))  # catches up, rotates, writes to the second file
    record = first.append(event(3))
    assert record.seq == 3
    summary = verify(tmp_path, KEY.public_key())
    assert summary.records == 3 and summary.files == 3


def test_torn_checkpoint_is_cut_on_restart(tmp_path: Path) -> None:
    filled(tmp_path, 5)
    with (tmp_path / CHECKPOINTS).open("ab") as handle:
        handle.write(b'{"seq":6,"he')  # a crash while signing
    writer = AuditWriter(tmp_path, KEY)
    writer.append(event(6))
    writer.checkpoint()
    assert verify(tmp_path, KEY.public_key()).last_checkpoint_seq == 6


def test_verify_while_a_writer_appends_and_signs(tmp_path: Path) -> None:
    writer = AuditWriter(tmp_path, KEY, checkpoint_every=3)
    writer.append(event(0))
    done = threading.Event()

    def write() -> None:
        for n in range(1, 400):
            writer.append(event(n))
        done.set()

    threading.Thread(target=write).start()
    verified = 0
    while not done.is_set():
        verified = verify(tmp_path, KEY.public_key()).records  # never "missing tail" nor a torn line
    assert verify(tmp_path, KEY.public_key()).records == 400 and verified <= 400


def test_a_line_still_being_written_is_left_for_later(tmp_path: Path) -> None:
    filled(tmp_path, count=5)
    newest = log_files(tmp_path)[-1]
    with newest.open("ab") as log:
        log.write(b'{"seq": 6, "act')  # a writer is half way through its write
    assert verify(tmp_path, KEY.public_key()).records == 5


def test_records_whose_flush_failed_are_cut_from_the_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writer = filled(tmp_path, 3)
    size = log_files(tmp_path)[-1].stat().st_size

    def flush_fails(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr("audit.writer.os.fdatasync", flush_fails)
    with pytest.raises(AuditUnavailable, match="Input/output error"):
        writer.append(event(4))
    assert log_files(tmp_path)[-1].stat().st_size == size, "a record its caller was refused for is not kept"
    monkeypatch.undo()
    monkeypatch.setattr("audit.writer.RETRY_AFTER_S", 0.0)
    assert writer.append(event(5)).seq == 4
    assert verify(tmp_path, KEY.public_key()).records == 4


def test_a_failed_checkpoint_keeps_the_durable_records_and_fails_closed_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writer = AuditWriter(tmp_path, KEY, checkpoint_every=2)
    writer.append(event(1))

    def sign_fails(fd: int) -> None:  # only checkpoints fsync; records fdatasync
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("audit.writer.os.fsync", sign_fails)
    assert writer.append(event(2)).seq == 2, "the record is durable: its request may be answered"
    assert writer.failure and "checkpoints" in writer.failure
    with pytest.raises(AuditUnavailable):
        writer.append(event(3))
    monkeypatch.undo()
    with (tmp_path / CHECKPOINTS).open("ab") as checkpoints:
        checkpoints.write(b'{"seq": 2, "he')  # torn by the failed write
    monkeypatch.setattr("audit.writer.RETRY_AFTER_S", 0.0)
    writer.append(event(4))
    writer.checkpoint()
    assert verify(tmp_path, KEY.public_key()).last_checkpoint_seq == 3


def test_any_string_is_recorded_and_verifies(tmp_path: Path) -> None:
    """Regression: a lone surrogate or a NUL in any field made the record unencodable (and stopped
    the writer for every request); now it is written as its JSON escape and verifies."""
    writer = AuditWriter(tmp_path, KEY)
    writer.append(event(0, resource="model\ud800", username="a\x00b", prompt="\udcff"))
    writer.append(event(1))
    assert writer.failure is None
    [hostile, _] = read_records(tmp_path)
    assert hostile["resource"] == "model\ud800" and hostile["username"] == "a\x00b"
    assert verify(tmp_path, KEY.public_key()).records == 2


def test_newest_first_reads_from_the_end_and_stops_with_the_page(tmp_path: Path) -> None:
    """A page of the newest records reads about a page, not the whole log: here the
    oldest file is unreadable garbage and is never reached."""
    writer = AuditWriter(tmp_path, KEY, max_file_bytes=4096)
    for n in range(200):
        writer.append(event(n))
    files = log_files(tmp_path)
    assert len(files) > 3
    oldest = files[0].read_bytes()
    files[0].write_bytes(b"not json\n" * 10)
    newest = list(itertools.islice(read_records(tmp_path, newest_first=True), 5))
    assert [r["request_id"] for r in newest] == ["r199", "r198", "r197", "r196", "r195"]
    files[0].write_bytes(oldest)
    since = json.loads(files[-2].read_bytes().splitlines()[0])["time"]
    forwards = list(read_records(tmp_path, since=since))
    assert forwards[-1]["request_id"] == "r199", "oldest first skips files wholly before `since`"
    everything = list(read_records(tmp_path, newest_first=True, since=since))
    assert [r["seq"] for r in everything] == sorted((r["seq"] for r in forwards), reverse=True)


def test_newest_first_leaves_a_line_still_being_written(tmp_path: Path) -> None:
    writer = AuditWriter(tmp_path, KEY)
    writer.append(event(0))
    with log_files(tmp_path)[0].open("ab") as handle:
        handle.write(b'{"seq": 2, "half')
    assert [r["request_id"] for r in read_records(tmp_path, newest_first=True)] == ["r0"]


def test_a_log_written_before_targets_verifies_displays_and_takes_new_records(tmp_path: Path) -> None:
    """A log the previous release wrote (no target, key, model or reason; a refusal's outcome was
    `error`; a CLI failure's text in `resource`) still verifies, reads and exports, and the chain
    goes on with records of the new shape."""
    log = tmp_path / "audit"
    shutil.copytree(Path(__file__).parent / "data" / "audit-before-targets", log)
    public = serialization.load_pem_public_key((log / "public.pem").read_bytes())
    assert isinstance(public, Ed25519PublicKey)
    assert verify(log, public).records == 3
    old = list(read_records(log))
    assert [r["outcome"] for r in old] == ["allowed", "error", "error"] and "target" not in old[0]
    assert list(read_records(log, where=RecordFilter(outcome="error"))) == old[1:]
    assert not list(read_records(log, where=RecordFilter(target=ObjectFilter(name="admin", kind="user"))))

    signer = Ed25519PrivateKey.generate()
    writer = AuditWriter(log, signer)
    writer.append(AuditEvent(request_id="r4", action="users.grant", outcome="allowed", status=200,
                             resource="/admin/users/bob/roles",
                             target=Target(kind="user", name="bob", roles=["trainer"])))
    writer.append(AuditEvent(request_id="r5", action="chat.completions", outcome="invalid", status=404,
                             resource="/v1/chat/completions", model="nope", reason="model_not_found"))
    writer.close()
    records = list(read_records(log))
    assert [r["seq"] for r in records] == [1, 2, 3, 4, 5] and records[3]["prev_hash"] == records[2]["hash"]
    bob = RecordFilter(target=ObjectFilter(name="bob", kind="user"))
    assert [r["target"]["name"] for r in read_records(log, where=bob)] == ["bob"]
