"""The state directory's modes: what its passages (the root and run/, which the database's user
may pass through) hold is closed to others, the settings file is 0600, a queue database is made
0600, and a restored file is readable by others only where it is public, whatever mode a backup
(which may be crafted) gives it. The same on a real appliance, checked as the database's user:
tests/integration/test_keycloak_postgres.py and test_backup.py."""

from __future__ import annotations

import os
import stat
import tarfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.home import PUBLIC_FILES, Home, public_file
from appliance.queue import connect
from installer.backup import KEYCLOAK_DUMP, restored_mode


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.mark.parametrize("kind", ["file", "directory", "fifo"])
@pytest.mark.parametrize("where", ["root", "run"])
@pytest.mark.parametrize("given_mode", [0o777, 0o755, 0o644, 0o604, 0o601, 0o750, 0o700])
def test_what_a_passage_holds_is_closed_to_others(home: Home, kind: str, where: str, given_mode: int) -> None:
    entry = (home.root if where == "root" else home.run) / f"entry-{kind}"
    if kind == "file":
        entry.write_text("x")
    elif kind == "directory":
        entry.mkdir()
    else:
        os.mkfifo(entry)
    entry.chmod(given_mode)
    home.ensure()
    assert mode(entry) == given_mode & 0o770


def test_a_link_in_a_passage_and_what_it_names_are_left_alone(home: Home, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    outside.chmod(0o755)
    (home.root / "linked").symlink_to(outside)
    home.ensure()
    assert mode(outside) == 0o755 and (home.root / "linked").is_symlink()


@pytest.mark.parametrize("vanishes_at", ["is_symlink", "stat"])
def test_an_entry_removed_while_a_passage_is_closed_is_passed_over(home: Home, monkeypatch: pytest.MonkeyPatch,
                                                                   vanishes_at: str) -> None:
    """Programs make and remove files in run/ while a command closes it (an atomic write's temporary
    file): one gone since the listing is passed over, the others still closed, and the command goes
    on (it failed with 'cannot create state directory')."""
    for name in ("gone", "kept"):
        (home.run / name).write_text("x")
        (home.run / name).chmod(0o644)
    listing = os.scandir

    def scandir(path: Path) -> list[os.DirEntry[str]]:
        entries = sorted(listing(path), key=lambda entry: entry.name)
        for entry in entries:  # the listing is made; then the file goes, before it is looked at
            if entry.name == "gone":
                if vanishes_at == "stat":
                    entry.is_symlink()  # cached by the entry from here on
                os.unlink(entry.path)
        return entries

    monkeypatch.setattr("appliance.home.os.scandir", scandir)
    home.ensure()
    assert mode(home.run / "kept") == 0o640 and not (home.run / "gone").exists()


@pytest.mark.parametrize("given_mode", [0o644, 0o666, 0o640, 0o600, 0o604])
def test_the_settings_file_is_0600(home: Home, given_mode: int) -> None:
    home.settings_file.write_text("[cache]\nttl_s = 1.0\n")
    home.settings_file.chmod(given_mode)
    home.ensure()
    assert mode(home.settings_file) == 0o600


def test_a_queue_database_is_made_0600_with_its_side_files(home: Home) -> None:
    path = home.root / "finetune" / "jobs" / "jobs.sqlite"
    with connect(path, "create table if not exists t (x integer);") as db:
        db.execute("insert into t values (1)")
        sides = [path.with_name(path.name + suffix) for suffix in ("-wal", "-shm")]
        assert mode(path) == 0o600 and all(mode(side) == 0o600 for side in sides if side.exists())


def test_an_older_queue_database_becomes_0600(home: Home) -> None:
    path = home.root / "older.sqlite"
    path.touch(mode=0o644)
    path.chmod(0o644)
    with connect(path, "create table if not exists t (x integer);"):
        assert mode(path) == 0o600


names = st.lists(st.text(st.characters(min_codepoint=0x61, max_codepoint=0x7a), min_size=1, max_size=8),
                 min_size=1, max_size=4).map("/".join)


@given(names, st.integers(0, 0o7777))
def test_a_restored_private_file_is_at_most_0640(name: str, member_mode: int) -> None:
    member = tarfile.TarInfo(f"state/{name}")
    member.mode = member_mode
    restored = restored_mode(member)
    expected = 0o644 if public_file(name) else 0o640
    assert restored == member_mode & expected and not restored & 0o7133


@given(st.sampled_from(["tls/ca.pem", "tls/gateway.pem"]),
       st.integers(0, 0o7777))
def test_a_restored_public_file_may_stay_readable_by_others(name: str, member_mode: int) -> None:
    member = tarfile.TarInfo(f"state/{name}")
    member.mode = member_mode
    assert public_file(name) and restored_mode(member) == member_mode & 0o644


@pytest.mark.parametrize("name", ["settings.toml", "secrets/tls-ca.key", "finetune/jobs/jobs.sqlite",
                                  "tls/ca.key", "tls/ca.pem.bak/x", "api-keys.json", "audit/2026.jsonl",
                                  "finetune/rl-runs/7/policy/trained-2/adapter.bin"])
def test_private_files_are_not_on_the_public_list(name: str) -> None:
    member = tarfile.TarInfo(f"state/{name}")
    member.mode = 0o644
    assert not public_file(name) and restored_mode(member) == 0o640, PUBLIC_FILES


def test_keycloaks_dump_is_0600() -> None:
    member = tarfile.TarInfo(KEYCLOAK_DUMP)
    member.mode = 0o644
    assert restored_mode(member) == 0o600
