"""Backups without Keycloak's database (an external Keycloak): what goes in and what stays out, a
restore that gives back the same files, modes and a verifying audit chain, copies of the SQLite
queues and the audit log taken while they are written, and every kind of bad backup or target
refused with nothing written (the PostgreSQL part: tests/integration/test_backup.py)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pty
import shutil
import sqlite3
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pyrage
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.errors import Conflict, Invalid, StateError
from appliance.home import Home, public_file
from appliance.settings import load_settings
from audit.keys import signing_key, verification_key
from audit.verify import verify
from audit.writer import AuditWriter
from installer import backup, backup_age
from installer.backup_archive import BackupError, passphrase_from
from tests.support.audit import event
from tests.support.legacy_backup import legacy_sealed

PASSPHRASE = b"correct horse battery staple"
# An age X25519 identity, as `age-keygen` writes its secret line: sealing and opening it costs no
# scrypt, so the tests of what the archive holds use it; the envelope's tests take both keys.
IDENTITY = str(pyrage.x25519.Identity.generate()).encode()
KEYS = pytest.mark.parametrize("key", [PASSPHRASE, IDENTITY], ids=["passphrase", "identity"])
CHUNK = 64 << 10  # age's payload chunk


@pytest.fixture
def state(home: Home) -> Home:
    """A state directory with something of each kind, and things that stay out of backups."""
    home.settings_file.write_text('[keycloak]\nmode = "external"\nurl = "https://idp:8443"\n'
                                  'gateway_client_secret = "s3cret"\n')
    (home.secrets / "gateway-client-secret").write_text("generated\n")
    (home.secrets / "gateway-client-secret").chmod(0o600)
    (home.root / "adapters.json").write_text('{"codes": 1}')
    (home.root / "adapters" / "codes" / "v1").mkdir(parents=True)
    (home.root / "adapters" / "codes" / "v1" / "adapter_model.safetensors").write_bytes(os.urandom(5 << 19))
    (home.root / "tasksets.json").write_text("{}")
    (home.root / "tasksets.json").chmod(0o644)
    (home.root / "tls").mkdir()
    (home.root / "tls" / "organisation.pem").write_text("a certificate: public")
    (home.root / "tls" / "organisation.pem").chmod(0o644)
    with sqlite3.connect(home.root / "batches.sqlite") as db:
        db.execute("create table requests (id integer primary key, body text)")
        db.executemany("insert into requests (body) values (?)", [(f"r{i}",) for i in range(100)])
    writer = AuditWriter(home.audit, signing_key(home), checkpoint_every=5)
    for n in range(12):
        writer.append(event(n))
    writer.close()
    for left_out in ("logs/gateway.log", "models/m/config.json", "cache/k.zip", "run/x.pid",
                     "artifacts/backups/old.backup", "finetune/jobs/1/checkpoints/checkpoint-5/weights.bin",
                     "keycloak/keycloak-26.7.3/bin/kc.sh", "postgres/data/PG_VERSION"):
        (home.root / left_out).parent.mkdir(parents=True, exist_ok=True)
        (home.root / left_out).write_text("not in a backup")
    (home.root / "finetune" / "jobs" / "1" / "job.json").write_text("{}")
    (home.root / "keycloak" / "events-cursor.json").write_text("{}")
    return home


def made(home: Home, tmp_path: Path, passphrase: bytes = IDENTITY) -> Path:
    path = tmp_path / "state.backup"
    backup.create_file(load_settings(home.settings_file), home, path, passphrase)
    return path


def files_under(root: Path) -> dict[str, tuple[bytes, int]]:
    return {p.relative_to(root).as_posix(): (p.read_bytes(), p.stat().st_mode & 0o777)
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_restore_gives_back_the_state_and_leaves_out_what_is_made_again(state: Home, tmp_path: Path) -> None:
    path = made(state, tmp_path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert b"s3cret" not in path.read_bytes() and b"generated" not in path.read_bytes()  # sealed, settings too
    target = tmp_path / "restored"
    with path.open("rb") as source:
        manifest = backup.restore(source, IDENTITY, "state.backup", target)
    assert manifest.keycloak == "external"
    before, after = files_under(state.root), files_under(target)
    left_out = {name for name in before if name not in after}
    assert left_out == {"logs/gateway.log", "models/m/config.json", "cache/k.zip", "run/x.pid",
                        "artifacts/backups/old.backup", "finetune/jobs/1/checkpoints/checkpoint-5/weights.bin",
                        "keycloak/keycloak-26.7.3/bin/kc.sh", "postgres/data/PG_VERSION", "audit/.lock",
                        "run/backup.lock"}
    for name, (data, mode) in after.items():  # same bytes (a queue: a copy of its rows); others read public files only
        kept = 0o600 if name == "settings.toml" else before[name][1] & (0o644 if public_file(name) else 0o640)
        assert mode == kept, name
        assert before[name][0] == data or name.endswith(".sqlite"), name
    assert after["tls/organisation.pem"][1] == 0o644 and after["tasksets.json"][1] == 0o640
    assert (target / "secrets").stat().st_mode & 0o777 == 0o700
    opened = {d.relative_to(target).as_posix(): oct(d.stat().st_mode & 0o777) for d in target.rglob("*")
              if d.is_dir() and d.stat().st_mode & 0o027}
    assert opened == {}, "no directory lets others in or the group write, wherever it was open"
    assert verify(target / "audit", verification_key(Home(target))).records == 12
    with sqlite3.connect(target / "batches.sqlite") as db:
        assert db.execute("select count(*) from requests").fetchone() == (100,)
    assert not list(tmp_path.glob(".restored.restoring-*"))


def test_verify_reads_it_whole_and_names_what_it_holds(state: Home, tmp_path: Path) -> None:
    path = made(state, tmp_path)
    with path.open("rb") as source:
        manifest = backup.read_backup(source, IDENTITY, "state.backup", None)
    assert manifest.source == str(state.root) and manifest.files == len(files_under(state.root)) - 10
    assert "state/secrets/gateway-client-secret" in manifest.members


def test_copies_of_a_queue_and_the_audit_log_written_meanwhile_are_whole(state: Home, tmp_path: Path) -> None:
    stop = threading.Event()

    def write_queue() -> None:
        with sqlite3.connect(state.root / "batches.sqlite", timeout=30, isolation_level=None) as db:
            db.execute("pragma journal_mode=wal")
            while not stop.is_set():
                db.execute("begin immediate")
                db.executemany("insert into requests (body) values (?)", [("x" * 500,)] * 20)
                db.execute("commit")

    def write_audit() -> None:
        writer = AuditWriter(state.audit, signing_key(state), checkpoint_every=3)
        n = 100
        while not stop.is_set():
            writer.append(event(n))
            n += 1
        writer.close()

    threads = [threading.Thread(target=write_queue), threading.Thread(target=write_audit)]
    for thread in threads:
        thread.start()
    try:
        paths = [made(state, tmp_path / str(i)) for i in range(3) if (tmp_path / str(i)).mkdir() is None]
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    for i, path in enumerate(paths):
        target = tmp_path / f"restored-{i}"
        with path.open("rb") as source:
            backup.restore(source, IDENTITY, path.name, target)
        assert verify(target / "audit", verification_key(Home(target))).records >= 12
        with sqlite3.connect(target / "batches.sqlite") as db:
            assert db.execute("pragma integrity_check").fetchone() == ("ok",)
            assert db.execute("select count(*) % 20 from requests where body != 'r'").fetchone() is not None


def refused(path: Path, tmp_path: Path, message: str, passphrase: bytes = IDENTITY) -> None:
    """Restoring `path` fails with `message` and leaves the target as it was (here: absent)."""
    target = tmp_path / "target"
    with path.open("rb") as source, pytest.raises(BackupError, match=message):
        backup.restore(source, passphrase, path.name, target)
    assert not target.exists() and not list(tmp_path.glob(".target.restoring-*"))
    with path.open("rb") as source, pytest.raises(BackupError, match=message):
        backup.read_backup(source, passphrase, path.name, None)


@KEYS
def test_a_wrong_passphrase_or_key_is_refused(state: Home, tmp_path: Path, key: bytes) -> None:
    other = b"incorrect horse battery" if key == PASSPHRASE else str(pyrage.x25519.Identity.generate()).encode()
    refused(made(state, tmp_path, key), tmp_path, "wrong passphrase or key file", other)
    refused(made_again(state, tmp_path, key), tmp_path, "wrong passphrase or key file",
            IDENTITY if key == PASSPHRASE else PASSPHRASE)  # the other kind of key


def made_again(home: Home, tmp_path: Path, key: bytes) -> Path:
    path = tmp_path / "again.backup"
    path.unlink(missing_ok=True)
    backup.create_file(load_settings(home.settings_file), home, path, key)
    return path


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 a zip", b"APPLIANCE-BACKUP", b"age-encryption.org",
                                     backup_age.MAGIC, backup_age.MAGIC + b"-> scrypt not base64 18\n",
                                     b"APPLIANCE-BACKUP\nnot json\n"])
def test_what_is_not_a_backup_is_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "foreign"
    path.write_bytes(content)
    refused(path, tmp_path, "not an appliance backup|header is damaged|cut short|damaged")
    refused(path, tmp_path, "not an appliance backup|header is damaged|cut short|damaged", PASSPHRASE)


def test_a_plain_tar_of_a_state_dir_is_refused(state: Home, tmp_path: Path) -> None:
    path = tmp_path / "plain.tar"
    with tarfile.open(path, "w") as archive:
        archive.add(state.root, arcname="state")
    refused(path, tmp_path, "not an appliance backup")


def test_a_plain_age_file_is_refused(tmp_path: Path) -> None:
    """An age file sealed with the right key that holds no appliance archive."""
    path = tmp_path / "plain.age"
    recipient = pyrage.x25519.Identity.from_str(IDENTITY.decode()).to_public()
    path.write_bytes(pyrage.encrypt(b"just a note\n" * 100, [recipient]))
    refused(path, tmp_path, "archive is damaged|has no manifest")


def test_a_backup_from_a_newer_appliance_is_refused(tmp_path: Path) -> None:
    manifest = json.loads(backup.Manifest("2026-01-01T00:00:00Z", "9.0.0", "/x", "external").to_json())
    manifest["format"] = backup.MANIFEST_FORMAT + 1
    refused(sealed_tar(tmp_path, [(member("manifest.json"), json.dumps(manifest).encode())]), tmp_path,
            "written by a newer appliance")


def whole(state: Home, tmp_path: Path, key: bytes) -> bytes:
    """One backup of `state` per key for every example of a Hypothesis test."""
    path = tmp_path / f"whole-{hash(key)}.backup"
    if not path.exists():
        made(state, tmp_path, key).rename(path)
    return path.read_bytes()


@KEYS
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.floats(0.0, 0.999))
def test_a_backup_cut_short_anywhere_is_refused(state: Home, tmp_path: Path, key: bytes, where: float) -> None:
    data = whole(state, tmp_path, key)
    cut = tmp_path / "cut-short.backup"
    cut.write_bytes(data[:int(len(data) * where)])
    refused(cut, tmp_path, "cut short|not an appliance backup|damaged|wrong passphrase|work factor", key)


@KEYS
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.floats(0.0, 0.999), bit=st.integers(0, 7))
def test_a_bit_flipped_anywhere_is_refused(state: Home, tmp_path: Path, key: bytes, where: float, bit: int) -> None:
    data = bytearray(whole(state, tmp_path, key))
    data[int(len(data) * where)] ^= 1 << bit
    flipped = tmp_path / "flipped.backup"
    flipped.write_bytes(bytes(data))
    refused(flipped, tmp_path, "damaged|wrong passphrase|not an appliance backup|cut short|work factor", key)


def chunks(data: bytes) -> tuple[bytes, list[bytes]]:
    """The header and nonce of an age file, and its payload's sealed chunks."""
    start = data.index(b"\n", data.index(b"\n---")) + 1 + 16
    head, rest = data[:start], data[start:]
    return head, [rest[i:i + CHUNK + 16] for i in range(0, len(rest), CHUNK + 16)]


@KEYS
def test_chunks_dropped_swapped_or_appended_are_refused(state: Home, tmp_path: Path, key: bytes) -> None:
    head, parts = chunks(made(state, tmp_path, key).read_bytes())
    assert len(parts) >= 3
    for name, altered in [
        ("dropped", [parts[0], *parts[2:]]), ("swapped", [parts[1], parts[0], *parts[2:]]),
        ("last-dropped", parts[:-1]), ("appended", [*parts, parts[-1]]), ("last-first", [parts[-1], *parts]),
    ]:
        path = tmp_path / f"{name}.backup"
        path.write_bytes(head + b"".join(altered))
        refused(path, tmp_path, "chunk is damaged or out of place|cut short|is damaged", key)


@KEYS
def test_the_round_trip_keeps_every_byte_with_either_key(state: Home, tmp_path: Path, key: bytes) -> None:
    path = made(state, tmp_path, key)
    assert path.read_bytes().startswith(backup_age.MAGIC)
    with path.open("rb") as source:
        backup.restore(source, key, path.name, tmp_path / "restored")
    adapter = "adapters/codes/v1/adapter_model.safetensors"
    assert files_under(tmp_path / "restored")[adapter][0] == files_under(state.root)[adapter][0]


def test_a_backup_of_earlier_versions_still_restores_and_is_checked(state: Home, tmp_path: Path) -> None:
    """The archive the appliance writes, in the envelope of earlier versions: it restores, and that
    envelope's checks still hold."""
    plain = pyrage.decrypt(made(state, tmp_path).read_bytes(), [pyrage.x25519.Identity.from_str(IDENTITY.decode())])
    data = legacy_sealed(plain, PASSPHRASE)
    path = tmp_path / "earlier.backup"
    path.write_bytes(data)
    with path.open("rb") as source:
        manifest = backup.restore(source, PASSPHRASE, path.name, tmp_path / "restored")
    assert manifest.files == 12
    adapter = "adapters/codes/v1/adapter_model.safetensors"
    assert files_under(tmp_path / "restored")[adapter][0] == files_under(state.root)[adapter][0]
    refused(path, tmp_path, "wrong passphrase or key file", b"incorrect horse battery")
    for altered, message in [(data[:-1], "cut short"), (data[:-40] + bytes([data[-40] ^ 1]) + data[-39:],
                                                        "damaged or out of place"),
                             (data + data[-100:], "data after its last chunk")]:
        bad = tmp_path / "bad-earlier.backup"
        bad.write_bytes(altered)
        refused(bad, tmp_path, message, PASSPHRASE)


def sealed_tar(tmp_path: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    """A correctly sealed backup whose archive holds `members` (what an attacker with the key could write)."""
    path = tmp_path / "crafted.backup"
    with path.open("wb") as out:
        writer = backup_age.AgeWriter(out, IDENTITY)
        with tarfile.open(fileobj=writer, mode="w|") as archive:  # type: ignore[call-overload]
            for info, data in members:
                info.size = len(data) if info.isfile() else 0
                archive.addfile(info, io.BytesIO(data) if info.isfile() else None)
        writer.close()
    return path


def member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, 0o644
    return info


def sparse(name: str) -> tarfile.TarInfo:
    info = member(name, tarfile.GNUTYPE_SPARSE)
    info.sparse = [(0, 0)]  # type: ignore[attr-defined]
    return info


@pytest.mark.parametrize("hostile", [
    member("state/keycloak/keycloak-26.7.3/bin/kc.sh"), member("state/postgres/data/PG_VERSION"),
    member("state/run/supervisord.conf"), member("state/models/m/config.json"), member("state/x.partial"),
    member("state/finetune/jobs/1/checkpoints/c"), member("state/audit/.lock"),
    member("state/../../escaped"), member("/etc/passwd"), member("state/a/./b"), member("state"),
    member("elsewhere/file"), member("state/link", tarfile.SYMTYPE, "/etc/shadow"),
    member("state/hard", tarfile.LNKTYPE, "state/settings.toml"), member("state/dev", tarfile.CHRTYPE),
    member("state/fifo", tarfile.FIFOTYPE), member("state/a\\..\\b"), sparse("state/sparse"),
])
def test_members_that_are_not_plain_files_of_the_state_dir_are_refused(tmp_path: Path,
                                                                       hostile: tarfile.TarInfo) -> None:
    refused(sealed_tar(tmp_path, [(hostile, b"x")]), tmp_path,
            "not a path this appliance writes|neither a regular|a path a backup never holds")
    assert not (tmp_path.parent / "escaped").exists()


def test_a_manifest_that_does_not_match_the_files_is_refused(tmp_path: Path) -> None:
    manifest = backup.Manifest("2026-01-01T00:00:00Z", "0.1.0", "/x", "external",
                               {"state/settings.toml": {"size": 1, "sha256": "00" * 32}})
    refused(sealed_tar(tmp_path, [(member("state/settings.toml"), b"y"),
                                  (member("manifest.json"), manifest.to_json())]), tmp_path, "differ from its manifest")
    refused(sealed_tar(tmp_path, [(member("state/settings.toml"), b"y")]), tmp_path, "has no manifest")
    refused(sealed_tar(tmp_path, [(member("manifest.json"), b"[]")]), tmp_path, "manifest is damaged")


def test_only_a_fresh_state_dir_is_restored_into(state: Home, tmp_path: Path) -> None:
    path = made(state, tmp_path)
    target = tmp_path / "target"
    (target / "secrets").mkdir(parents=True)  # empty directories only: still fresh
    with path.open("rb") as source:
        backup.restore(source, IDENTITY, path.name, target)
    assert (target / "settings.toml").is_file()
    with path.open("rb") as source, pytest.raises(Conflict, match="not a fresh state directory"):
        backup.restore(source, IDENTITY, path.name, target)


def test_a_backup_never_overwrites_a_file(state: Home, tmp_path: Path) -> None:
    path = made(state, tmp_path)
    before = path.read_bytes()
    with pytest.raises(Conflict, match="exists"):
        made(state, tmp_path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir() if "partial" in p.name] == []


def test_the_passphrase_comes_from_a_private_key_file_the_environment_or_stdin(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("k" * 40 + "\n")
    key.chmod(0o644)
    with pytest.raises(Invalid, match="readable by others"):
        passphrase_from(key, io.BytesIO())
    os.mkfifo(tmp_path / "fifo", 0o600)  # would block a reader for ever
    (tmp_path / "link").symlink_to(key)
    for odd, message in [(tmp_path / "fifo", "not a regular file"), (tmp_path / "link", "cannot read key file"),
                         (tmp_path / "missing", "cannot read key file")]:
        with pytest.raises(Invalid, match=message):
            passphrase_from(odd, io.BytesIO())
    key.chmod(0o600)
    assert passphrase_from(key, io.BytesIO()) == b"k" * 40
    assert passphrase_from(None, io.BytesIO(), {"APPLIANCE_BACKUP_PASSPHRASE": "p" * 12}) == b"p" * 12
    assert passphrase_from(None, io.BytesIO(b"s" * 20 + b"\nmore"), {}) == b"s" * 20
    for short in (b"", b"short\n"):
        with pytest.raises(Invalid, match="needs at least 12"):
            passphrase_from(None, io.BytesIO(short), {})
    key.write_bytes(b"first line of a key\nsecond line\n")
    with pytest.raises(Invalid, match="more than one line"):
        passphrase_from(key, io.BytesIO())
    key.write_bytes(b" spaced key file contents \r\n")  # the same passphrase whichever way it comes
    spaced = b" spaced key file contents "
    assert passphrase_from(key, io.BytesIO()) == passphrase_from(None, key.open("rb"), {}) == spaced


def test_a_bomb_of_extended_headers_is_refused_before_it_is_read(tmp_path: Path) -> None:
    info = member("state/settings.toml")
    info.pax_headers = {"comment": "x" * (1 << 20)}  # a megabyte of header, held whole by tarfile
    path = tmp_path / "crafted.backup"
    with path.open("wb") as out:
        writer = backup_age.AgeWriter(out, IDENTITY)
        with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as archive:  # type: ignore[call-overload]
            info.size = 1
            archive.addfile(info, io.BytesIO(b"x"))
        writer.close()
    refused(path, tmp_path, "extended tar header")


def test_restored_files_lose_execute_bits_and_are_given_to_service_accounts_only(tmp_path: Path) -> None:
    script = member("state/adapters/run.sh")
    script.mode, script.uname, script.gname = 0o4777, "nobody", "nogroup"
    directory = member("state/adapters", tarfile.DIRTYPE)
    directory.mode = 0o777
    data = b"#!/bin/sh\n"
    manifest = backup.Manifest("2026-01-01T00:00:00Z", "0.1.0", "/x", "external", {
        "state/adapters": {"size": 0, "sha256": "", "directory": True},
        "state/adapters/run.sh": {"size": len(data), "sha256": __import__("hashlib").sha256(data).hexdigest()}})
    path = sealed_tar(tmp_path, [(directory, b""), (script, data), (member("manifest.json"), manifest.to_json())])
    with path.open("rb") as source:
        backup.restore(source, IDENTITY, path.name, tmp_path / "target")
    restored = (tmp_path / "target" / "adapters" / "run.sh").stat()
    assert restored.st_mode & 0o7777 == 0o640 and restored.st_uid == os.geteuid()
    assert (tmp_path / "target" / "adapters").stat().st_mode & 0o777 == 0o750  # the state dir's first level


@pytest.mark.parametrize("members", [
    [member("state/a"), member("state/a/b")], [member("state/a"), member("state/a/b", tarfile.DIRTYPE)],
    [member("state/a/b"), member("state/a")],
])
def test_members_that_collide_are_refused(tmp_path: Path, members: list[tarfile.TarInfo]) -> None:
    refused(sealed_tar(tmp_path, [(info, b"x") for info in members]), tmp_path, "collide")


def test_backups_are_not_written_inside_the_state_dir_nor_two_at_once(state: Home, tmp_path: Path) -> None:
    settings = load_settings(state.settings_file)
    with pytest.raises(Invalid, match="inside the state directory"):
        backup.create_file(settings, state, state.root / "adapters" / "x.backup", IDENTITY)
    with backup._one_at_a_time(state), pytest.raises(Conflict, match="another backup"):
        backup.create_file(settings, state, tmp_path / "second.backup", IDENTITY)
    (state.run / "backup-killed").mkdir()  # the scratch copies of one killed mid-way
    made(state, tmp_path)
    assert not (state.run / "backup-killed").exists()


def test_the_store_keeps_each_appliance_its_own_and_leaves_other_objects(state: Home, tmp_path: Path) -> None:
    settings = load_settings(state.settings_file)
    store = state.root / "artifacts"
    others = [store / "backups" / "2025-12-31-before-upgrade.backup",
              store / backup.store_prefix(state) / "pre-upgrade-manual.backup",
              store / "backups" / "0123456789abcdef" / "appliance-20260101T000000Z-abcdef.backup"]
    for other in others:
        other.parent.mkdir(parents=True, exist_ok=True)
        other.write_text("not ours to remove")
    keys = [backup.create_in_store(settings, state, IDENTITY, keep=1)[0] for _ in range(2)]
    assert backup.stored(settings, state) == [keys[-1]]
    assert all(other.exists() for other in others)


def test_a_restore_target_that_is_a_link_is_refused(state: Home, tmp_path: Path) -> None:
    path = made(state, tmp_path)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "target").symlink_to(tmp_path / "elsewhere")
    with path.open("rb") as source, pytest.raises(Conflict, match="symbolic link"):
        backup.restore(source, IDENTITY, path.name, tmp_path / "target")


def test_an_external_keycloak_database_is_left_to_the_organisation(home: Home, tmp_path: Path) -> None:
    password = tmp_path / "password"
    password.write_text("p" * 20)
    password.chmod(0o600)
    home.settings_file.write_text(f'[keycloak]\npostgres_url = "postgresql://kc@db.bank:5432/keycloak"\n'
                                  f'postgres_password_file = "{password}"\npostgres_ca_file = "/etc/bank/ca.pem"\n')
    path = made(home, tmp_path)
    with path.open("rb") as source:
        manifest = backup.read_backup(source, IDENTITY, path.name, None)
    assert manifest.keycloak == "external-postgres" and backup.KEYCLOAK_DUMP not in manifest.members


def age_tool() -> str:
    """Debian's `age` (installed here as other tests install Debian packages, when run as root)."""
    if shutil.which("age") is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "age"], capture_output=True,
                       check=False)
    found = shutil.which("age")
    assert found, "the age tool is needed for this test: apt-get install age"
    return found


def age_with_terminal(arguments: list[str], passphrase: bytes) -> bytes:
    """Runs `age` with a terminal of its own (it reads a passphrase from the terminal alone) and
    answers its prompt; returns what it printed there."""
    pid, terminal = pty.fork()
    if pid == 0:
        os.execv(arguments[0], arguments)
    said = b""
    while b"passphrase" not in said.lower():
        said += os.read(terminal, 1024)
    os.write(terminal, passphrase + b"\n")
    with contextlib.suppress(OSError):  # EIO once age exits and the terminal closes
        while chunk := os.read(terminal, 1024):
            said += chunk
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, said
    return said


def test_the_age_tool_opens_a_backup_and_verify_refuses_a_tampered_one(state: Home, tmp_path: Path) -> None:
    """Away from the appliance: `age -d` with the identity file `age-keygen` made, and with the
    passphrase; then `appliance backup verify` refuses the same file with one byte changed."""
    age = age_tool()
    identity = tmp_path / "backup.key"
    subprocess.run([f"{age}-keygen", "-o", str(identity)], capture_output=True, check=True)
    identity.chmod(0o600)
    key = passphrase_from(identity, io.BytesIO())
    assert key.startswith(b"AGE-SECRET-KEY-1")
    for sealed_with, opened_by in [(key, ["-i", str(identity)]), (PASSPHRASE, [])]:
        path = made_again(state, tmp_path, sealed_with)
        plain = tmp_path / "plain.tar"
        plain.unlink(missing_ok=True)
        command = [age, "-d", *opened_by, "-o", str(plain), str(path)]
        if opened_by:
            subprocess.run(command, capture_output=True, check=True)
        else:
            age_with_terminal(command, PASSPHRASE)
        with tarfile.open(plain) as archive:
            names = archive.getnames()
            manifest = json.loads(archive.extractfile("manifest.json").read())  # type: ignore[union-attr]
            settings_file = archive.extractfile("state/settings.toml").read()  # type: ignore[union-attr]
        assert names[-1] == "manifest.json" and set(manifest["members"]) == set(names[:-1])
        assert settings_file == state.settings_file.read_bytes()
    environment = {**os.environ, "APPLIANCE_HOME": str(state.root)}
    verify_command = [str(Path(sys.executable).parent / "appliance"), "backup", "verify", "--key-file", str(identity)]
    path = made_again(state, tmp_path, key)
    assert subprocess.run([*verify_command, str(path)], env=environment, capture_output=True).returncode == 0
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    refused_run = subprocess.run([*verify_command, str(path)], env=environment, capture_output=True, text=True)
    assert refused_run.returncode != 0 and "chunk is damaged or out of place" in refused_run.stderr + refused_run.stdout


def age_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "backup-age"]


def test_a_refusal_early_in_a_streamed_backup_names_its_cause_and_stops_age(tmp_path: Path) -> None:
    """A hostile member ahead of megabytes still sealed: the member is what is refused (not the age
    thread's write to a closed pipe), and that thread ends."""
    path = sealed_tar(tmp_path, [(member("state/../../escaped"), b"x"), (member("state/big"), os.urandom(4 << 20))])
    refused(path, tmp_path, "not a path this appliance writes")
    assert age_threads() == []


def test_a_backup_that_fails_midway_leaves_no_file_and_no_age_thread(state: Home, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def unreadable(path: Path, home: Home, scratch: Path) -> Path:
        raise OSError(f"cannot read {path}")

    monkeypatch.setattr(backup, "_snapshot", unreadable)
    for key in (IDENTITY, PASSPHRASE):
        with pytest.raises(StateError, match="cannot copy"):
            made(state, tmp_path, key)
        assert age_threads() == [] and list(tmp_path.glob("*backup*")) == []


def test_a_passphrase_backup_asking_for_excessive_scrypt_work_is_refused_at_once(state: Home, tmp_path: Path) -> None:
    """A header crafted to ask for 2^30 scrypt (a terabyte of memory): refused before any is done."""
    data = made(state, tmp_path, PASSPHRASE).read_bytes()
    stanza = data.split(b"\n")[1]
    assert stanza.startswith(b"-> scrypt ")
    crafted = tmp_path / "crafted.backup"
    crafted.write_bytes(data.replace(stanza, stanza.rsplit(b" ", 1)[0] + b" 30", 1))
    refused(crafted, tmp_path, "work factor is far above", PASSPHRASE)


class _Full(io.BytesIO):
    def write(self, data: bytes) -> int:  # type: ignore[override]
        raise OSError(28, "No space left on device")


def test_a_backup_whose_file_cannot_be_written_says_why(state: Home) -> None:
    for key in (IDENTITY, PASSPHRASE):
        with pytest.raises((StateError, OSError), match="No space left on device"):
            backup.create(load_settings(state.settings_file), state, _Full(), key)
        assert age_threads() == []
