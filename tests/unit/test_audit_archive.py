"""Archiving the audit log to the local artifact store and verifying the copies."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from appliance.artifacts import LocalStore
from appliance.errors import ArtifactStoreError
from audit import AuditVerificationError, AuditWriter, archive, fetch, verify
from tests.support.audit import event

KEY = Ed25519PrivateKey.generate()


def written(directory, count: int) -> AuditWriter:
    writer = AuditWriter(directory, KEY, checkpoint_every=25, max_file_bytes=4096)
    for n in range(count):
        writer.append(event(n))
    return writer


def test_closed_files_and_their_checkpoints_round_trip(tmp_path) -> None:
    written(tmp_path / "log", 120)
    store = LocalStore(tmp_path / "store")
    done = archive(tmp_path / "log", store, retain_days=1, require_lock=True)
    assert done.files and not done.locked, "a local store is not write-once, and says so"
    assert all((tmp_path / "store" / key).stat().st_mode & 0o777 == 0o400 for key in done.files)
    again = archive(tmp_path / "log", store, retain_days=1, require_lock=True)
    assert again.files == [] and again.checkpoints is None, "nothing closed is copied twice"
    copy = tmp_path / "copy"
    copy.mkdir()
    assert fetch(store, copy) == len(done.files)
    summary = verify(copy, KEY.public_key())
    # The open file stays on the host; every checkpoint in the archive vouches for archived records.
    assert summary.records < 120 and summary.last_checkpoint_seq <= summary.records
    assert summary.checkpoints >= 1


def test_tampered_archive_copy_is_named(tmp_path) -> None:
    written(tmp_path / "log", 120)
    store = LocalStore(tmp_path / "store")
    done = archive(tmp_path / "log", store, retain_days=1, require_lock=True)
    target = tmp_path / "store" / done.files[0]
    target.chmod(0o600)
    target.write_bytes(target.read_bytes().replace(b'"status":200', b'"status":403', 1))
    copy = tmp_path / "copy"
    copy.mkdir()
    fetch(store, copy)
    with pytest.raises(AuditVerificationError, match=r"audit-000001.jsonl:1 \(seq 1\): hash mismatch"):
        verify(copy, KEY.public_key())


def test_empty_archive_and_escaping_keys_are_errors(tmp_path) -> None:
    store = LocalStore(tmp_path / "store")
    with pytest.raises(ArtifactStoreError, match="holds no audit log files"):
        fetch(store, tmp_path)
    with pytest.raises(ArtifactStoreError, match="leaves the store"):
        store.put("../outside", b"x", retain_days=1)
