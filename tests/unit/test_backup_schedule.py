"""Scheduled backups (the supervised scheduler's steps, an external Keycloak so no database): when one
is due, retention, an audit record either way, and settings that cannot work refused."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from appliance.errors import Invalid, SettingsError
from appliance.home import Home
from appliance.settings import load_settings
from audit.writer import log_files
from installer import backup_schedule
from installer.backup import stored
from installer.programs import scheduler_programs

EXTERNAL = '[keycloak]\nmode = "external"\nurl = "https://idp:8443"\ngateway_client_secret = "s"\n'


def scheduled(home: Home, tmp_path: Path, **backup: object) -> Path:
    key = tmp_path / "backup.key"
    key.write_text("k" * 44)
    key.chmod(0o600)
    fields = {"every_hours": 24, "keep": 2, "key_file": str(key), **backup}
    home.settings_file.write_text(EXTERNAL + "[backup]\n" + "".join(f"{k} = {json.dumps(v)}\n"
                                                                     for k, v in fields.items()))
    return key


def records(home: Home) -> list[dict[str, object]]:
    return [json.loads(line) for path in log_files(home.audit) for line in path.read_text().splitlines()]


def test_a_schedule_needs_a_key_file(home: Home) -> None:
    home.settings_file.write_text("[backup]\nevery_hours = 6\n")
    with pytest.raises(SettingsError, match="every_hours needs key_file"):
        load_settings(home.settings_file)


def test_the_scheduler_runs_only_when_backups_are_scheduled(home: Home, tmp_path: Path) -> None:
    home.settings_file.write_text(EXTERNAL)
    assert scheduler_programs(load_settings(home.settings_file), home) == []
    scheduled(home, tmp_path)
    [program] = scheduler_programs(load_settings(home.settings_file), home)
    assert program.name == "backup-scheduler" and "APPLIANCE_BACKUP_PASSPHRASE" not in program.environment


def test_backups_fall_due_by_the_newest_and_only_the_newest_are_kept(home: Home, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    scheduled(home, tmp_path)
    monkeypatch.setenv("APPLIANCE_HOME", str(home.root))  # where the audit records go
    settings = load_settings(home.settings_file)
    now = datetime.now(UTC)
    assert backup_schedule.due_in(settings, home, now) == 0  # none yet: now
    keys = [backup_schedule.take(settings, home) for _ in range(3)]
    kept = stored(settings, home)
    assert len(kept) == 2 and set(kept) <= set(keys)  # the newest two (names sort by time to the second)
    later = datetime.now(UTC)  # after the newest: it is due a day after it (to the second)
    assert 24 * 3600 - 10 < backup_schedule.due_in(settings, home, later) <= 24 * 3600
    assert backup_schedule.due_in(settings, home, now + timedelta(hours=25)) < 0
    taken = [r for r in records(home) if r["action"] == "backup.create"]
    assert len(taken) == 3 and all(r["outcome"] == "allowed" and r["username"] == "backup-scheduler" for r in taken)
    assert {r["target"]["name"] for r in taken} == set(keys)  # type: ignore[index]


def test_a_failed_backup_is_an_audit_record_and_changes_nothing(home: Home, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    key = scheduled(home, tmp_path)
    key.chmod(0o644)
    monkeypatch.setenv("APPLIANCE_HOME", str(home.root))
    settings = load_settings(home.settings_file)
    with pytest.raises(Invalid, match="readable by others"):
        backup_schedule.take(settings, home)
    assert stored(settings, home) == []
    [failed] = [r for r in records(home) if r["action"] == "backup.create"]
    assert failed["outcome"] == "invalid" and "readable by others" in str(failed["error"])


@pytest.mark.parametrize("key", ["backups/0123456789abcdef/appliance-20261203T080102Z-000042-abc123.backup"])
def test_a_backup_is_dated_by_its_name(key: str) -> None:
    assert backup_schedule.taken_at(key) == datetime(2026, 12, 3, 8, 1, 2, tzinfo=UTC)
    for foreign in ("backups/other.tar", "backups/appliance-2026.backup", "backups/appliance-99999999T999999Z"):
        assert backup_schedule.taken_at(foreign) is None
