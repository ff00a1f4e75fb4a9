"""Scheduled backups' settings."""

from __future__ import annotations

from pydantic import Field, model_validator

from appliance.settings.section import Section


class BackupSettings(Section):
    """Backups taken on a schedule into the artifact store (`appliance backup create` takes one at any time)."""

    IN_SUPERVISOR_CONFIG = False

    every_hours: float | None = Field(
        None, gt=0, le=24 * 366, description="Take a backup into the artifact store this often, while the appliance "
        "runs (unset: no scheduled backups).")
    keep: int = Field(7, ge=1, le=10000, description="Scheduled backups kept in the store: after each new one, "
                      "older ones beyond this many are removed.")
    key_file: str | None = Field(
        None, description="The key file (0600, at least 12 bytes) whose contents seal scheduled backups; keep a copy "
        "away from the appliance: without it no backup can be restored.")

    @model_validator(mode="after")
    def _schedule_needs_a_key(self) -> BackupSettings:
        if self.every_hours is not None and not self.key_file:
            raise ValueError("every_hours needs key_file: a scheduled backup is sealed with the key file's contents")
        return self
