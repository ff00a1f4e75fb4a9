"""Audit records the gateway writes outside a request's own: the summaries it keeps (refused
requests, failed Keycloak logins, monitoring reads), connections the listener closed for
slowness, refusals at the published login endpoints, and canary decisions."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio

from appliance.changes import Target
from appliance.settings.audit import AuditSettings
from audit import AuditEvent, AuditUnavailable, AuditWriter
from serve.canary import Ended
from serve.metrics import Metrics
from serve.summaries import Refusals, Summaries, write_due

log = logging.getLogger("appliance.gateway")
# Monitoring routes need role admin, so their readers are few; past this many in one interval the
# rest are summarised together (user "*").
MONITORING_USERS = 64
SLOW_CLIENT_ERRORS = {"headers": "request headers not complete in time", "body": "request body not complete in time",
                      "response": "responses left unread", "pipelined": "too many pipelined requests",
                      "evicted": "closed to make room past the connection cap while still sending its request",
                      "over_cap": "refused past the connection cap (no connection to close instead)"}


@dataclass(frozen=True)
class AuditSummaries:
    """What the gateway summarises per party and interval rather than recording each: refused
    requests (per source), failed Keycloak logins (per source), monitoring reads (per user)."""

    refusals: Refusals
    logins: Summaries
    monitoring: Summaries

    @classmethod
    def from_settings(cls, audit: AuditSettings) -> AuditSummaries:
        return cls(refusals=Refusals(audit.refusal_interval_s, audit.refusal_sources),
                   logins=Summaries(audit.refusal_interval_s, audit.refusal_sources, party_field="source",
                                    summary_action=None),
                   monitoring=Summaries(audit.monitoring_interval_s, MONITORING_USERS, party_field="subject",
                                        summary_action=None))

    def write_all(self, writer: AuditWriter) -> None:
        """Write every summary now, the current intervals' too (the gateway is stopping)."""
        for summaries in (self.refusals, self.monitoring, self.logins):
            write_due(writer, summaries, all_now=True)


def slow_client_accounting(writer: AuditWriter, refusals: Refusals,
                           metrics: Metrics) -> Callable[[str, str | None], None]:
    """What the listener calls for each connection it closes for slowness: counted in /metrics,
    and recorded in the audit log as a refusal of its source (408), so summarised per source and
    interval like any other; the write goes to a thread, off the event loop."""
    def closed(reason: str, source: str | None) -> None:
        metrics.slow_connections.labels(reason).inc()
        event = AuditEvent(request_id="", action="connection.closed_slow", outcome="denied", status=408,
                           source=source, error=SLOW_CLIENT_ERRORS[reason])
        if refusals.own_record(event):
            asyncio.get_running_loop().run_in_executor(None, _append_quietly, writer, event)
    return closed


def refusal_recorder(writer: AuditWriter, refusals: Refusals) -> Callable[[AuditEvent], Awaitable[None]]:
    """How a route outside the audited prefixes (the published login endpoints) records a refusal:
    summarised per source like any other, durable before its answer (AuditUnavailable raised)."""
    async def record(event: AuditEvent) -> None:
        if refusals.own_record(event):
            await anyio.to_thread.run_sync(writer.append, event)
    return record


def _append_quietly(writer: AuditWriter, event: AuditEvent) -> None:
    try:
        writer.append(event)
    except AuditUnavailable:
        pass  # the writer now reports the failure; requests and /readyz fail closed
    except Exception:  # nothing awaits this write: say so here
        log.exception("record of a slow connection not written")


def canary_recorder(writer: AuditWriter, metrics: Metrics) -> Callable[[Ended, str | None], Awaitable[None]]:
    """What records a canary analysis's decision: an audit record of the gateway naming the
    adapter and the canary version, with the figures of both versions (or why it failed)."""
    async def record(ended: Ended, error: str | None) -> None:
        metrics.canary_decisions.labels(ended.decision if error is None else "failed").inc()
        event = AuditEvent(request_id=uuid.uuid4().hex, action=f"adapters.canary_{ended.decision}",
                           outcome="allowed" if error is None else "error", status=200 if error is None else 500,
                           subject="canary-analysis", username="canary-analysis", client="gateway", source="local",
                           resource="gateway", target=Target(kind="adapter", name=ended.name,
                                                             version=ended.window.canary),
                           detail=ended.detail(), error=error)
        try:
            await anyio.to_thread.run_sync(writer.append, event)
        except AuditUnavailable:
            log.error("canary decision not recorded (the audit log is unwritable): %s", ended.detail())
    return record
