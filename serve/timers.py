"""The gateway's background timers, each a task of its lifespan: the realm's signing keys until
the first fetch, the audit summaries and checkpoints when due, and the audit log's archive."""

from __future__ import annotations

import logging

import anyio

from appliance.artifacts import artifact_store
from appliance.errors import ApplianceError
from appliance.home import Home
from appliance.settings import Settings
from audit import AuditUnavailable, AuditWriter, archive
from serve.auth import TokenValidator
from serve.metrics import Metrics
from serve.summaries import Summaries, write_due

log = logging.getLogger("appliance.gateway")
KEYS_RETRY_S = 5.0


async def keys_until_fetched(validator: TokenValidator) -> None:
    """Fetch the realm's signing keys until the first fetch succeeds (later refetches happen on
    an unknown key id, rate-limited, in the validator); /readyz says so meanwhile."""
    while not validator.has_keys:
        await anyio.sleep(KEYS_RETRY_S)
        await validator.try_refresh_keys()


async def summaries_timer(writer: AuditWriter, summaries: Summaries, interval_s: float) -> None:
    """Write the summary records (of refused requests, of monitoring reads) when their interval ends."""
    while True:
        await anyio.sleep(interval_s)
        await anyio.to_thread.run_sync(write_due, writer, summaries)


async def checkpoint_timer(writer: AuditWriter, interval_s: float) -> None:
    """Sign the chain head every interval even when traffic is idle, so a cut tail shows."""
    while True:
        await anyio.sleep(interval_s)
        try:
            await anyio.to_thread.run_sync(writer.checkpoint)
        except AuditUnavailable:
            pass  # the writer now reports the failure; requests and /readyz fail closed


async def archive_timer(settings: Settings, home: Home, metrics: Metrics) -> None:
    """Copy closed log files to the artifact store now and then; a failure is logged and
    counted (the local log stays authoritative and durable) and retried next time."""
    store = artifact_store(settings.artifacts, home)
    audit = settings.audit

    def copy() -> None:
        archive(home.audit, store, retain_days=audit.archive_retention_days,
                require_lock=audit.archive_require_lock)

    while True:
        await anyio.sleep(audit.archive_interval_s)
        try:
            await anyio.to_thread.run_sync(copy)
            metrics.archived_at.set_to_current_time()
        except (ApplianceError, OSError, ValueError) as exc:  # never let a copy take the gateway down
            metrics.archive_failures.inc()
            log.warning("audit archive failed: %s", exc.one_line() if isinstance(exc, ApplianceError) else exc)
