"""The installer's background program: the backup scheduler, when backups are scheduled.

Only its spec, so that `appliance up` starts supervisord without importing the backup code.
Keycloak's, PostgreSQL's and monitoring's programs are in their own modules.
"""

from __future__ import annotations

from appliance.home import Home
from appliance.programs import Program, python_module_program
from appliance.settings import Settings

BACKUP_SCHEDULER = "backup-scheduler"


def scheduler_programs(settings: Settings, home: Home) -> list[Program]:
    """The `appliance.programs` entry point: the scheduler, when backups are scheduled."""
    if settings.backup.every_hours is None:
        return []
    return [python_module_program(BACKUP_SCHEDULER, "installer.backup_schedule", home, priority=97,
                                  start_nice=settings.engine.yield_nice, stopwaitsecs=60)]
