"""The supervised `backup-scheduler` (when `backup.every_hours` is set): a backup into the artifact
store that often, sealed with `backup.key_file`, keeping the newest `backup.keep`. The newest
backup in the store decides when the next is due, so a restart neither repeats nor skips one. Each
backup, and each failure, is an audit record of the scheduler; a failure is retried after a while.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from appliance.changes import Change, Target, announce, failure_outcome
from appliance.errors import ApplianceError
from appliance.home import Home
from appliance.settings import Settings, load_settings
from installer.backup import create_in_store, stored
from installer.backup_archive import passphrase_from
from installer.programs import BACKUP_SCHEDULER

ACTOR = BACKUP_SCHEDULER
RETRY_S = 300.0
CHECK_EVERY_S = 60.0
log = logging.getLogger(ACTOR)


def taken_at(key: str) -> datetime | None:
    """When the backup stored under `key` was taken (from its name); None for a name not the appliance's."""
    stamp = key.rsplit("/", 1)[-1].removeprefix("appliance-")[:16]
    try:
        return datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)
    except ValueError:
        return None


def due_in(settings: Settings, home: Home, now: datetime) -> float:
    """Seconds until the next scheduled backup is due (0 or less: now)."""
    assert settings.backup.every_hours is not None
    times = [when for key in stored(settings, home) if (when := taken_at(key)) is not None]
    if not times:
        return 0.0
    return settings.backup.every_hours * 3600 - (now - max(times)).total_seconds()


def take(settings: Settings, home: Home) -> str:
    """One scheduled backup, recorded in the audit log either way; its key."""
    assert settings.backup.key_file is not None
    try:
        passphrase = passphrase_from(Path(settings.backup.key_file), sys.stdin.buffer, {})
        key, manifest = create_in_store(settings, home, passphrase, keep=settings.backup.keep)
    except ApplianceError as exc:
        announce(Change("backup.create", failure_outcome(exc), 1, None, error=exc.message, reason=exc.code,
                        actor=ACTOR))
        raise
    except Exception as exc:
        announce(Change("backup.create", "error", 1, None, error=repr(exc)[:500], reason=type(exc).__name__,
                        actor=ACTOR))
        raise
    announce(Change("backup.create", "allowed", 0, Target(kind="backup", name=key),
                    f"{manifest.files} files, {manifest.size} bytes before sealing; keeping the newest "
                    f"{settings.backup.keep}", actor=ACTOR))
    return key


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    home = Home.from_env()
    settings = load_settings(home.settings_file)
    not_before = 0.0  # after a failure: no new try before this (monotonic)
    while True:
        try:
            wait = max(due_in(settings, home, datetime.now(UTC)), not_before - time.monotonic())
            if wait <= 0:
                log.info("backup taken: %s", take(settings, home))
                continue
        except Exception as exc:  # whatever failed, the scheduler lives on and says so
            log.error("backup failed: %s; trying again in %.0f s",
                      exc.one_line() if isinstance(exc, ApplianceError) else repr(exc), RETRY_S)
            not_before = time.monotonic() + RETRY_S
            wait = RETRY_S
        time.sleep(min(max(wait, 1.0), CHECK_EVERY_S))


if __name__ == "__main__":
    main()
