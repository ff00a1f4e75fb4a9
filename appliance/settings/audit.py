"""The audit log's settings: checkpoints, rotation, archives and the counting of repeated records."""

from __future__ import annotations

from pydantic import Field

from appliance.settings.section import Section


class AuditSettings(Section):
    """The tamper-evident audit log."""

    IN_SUPERVISOR_CONFIG = False  # read by the programs from the settings file

    capture_text: bool = Field(
        False, description="Also store raw prompt and completion text (keyed hashes always)."
    )
    checkpoint_every: int = Field(1000, ge=1, description="Sign the chain head every N records...")
    checkpoint_interval_s: float = Field(60.0, gt=0, description="...or every T seconds.")
    max_file_bytes: int = Field(64 << 20, ge=4096, description="Rotate a log file at this size.")
    archive_interval_s: float = Field(
        300.0, ge=0, description="Copy closed log files to the artifact store this often (0: only "
        "by `appliance audit archive`)."
    )
    archive_retention_days: int = Field(
        365, ge=1, description="Object Lock (COMPLIANCE) retention of archived copies on S3."
    )
    refusal_interval_s: float = Field(
        10.0, gt=0, description="Refused requests (4xx) from one source: the first of each status per "
        "interval gets its own record, the rest one summary record with a count at the interval's end."
    )
    monitoring_interval_s: float = Field(
        300.0, gt=0, description="Monitoring reads a dashboard polls (services, host, pools, plans, jobs, "
        "adapters): the first of each per user and interval gets its own record, the rest one record "
        "with a count at the interval's end. Other admin reads (users, settings, the audit log) too, per "
        "user, path and query, when audit.count_repeated_reads: a new query always has its own record."
    )
    count_repeated_reads: bool = Field(
        True, description="Count an admin read repeated with the same query (a screen refreshing) into "
        "its interval's summary record; false records every read of users, settings and the audit log."
    )
    refusal_sources: int = Field(
        256, ge=1, description="Sources tracked apart per interval; refusals from further sources are "
        "summarised together (source '*'), so the log's growth stays bounded."
    )
    archive_require_lock: bool = Field(
        True, description="Refuse to archive to S3 unless the server keeps the Object Lock "
        "retention (false: accept plain, deletable copies, and say so)."
    )
