"""Refused requests and monitoring reads summarised, so that neither a client nor a polling
dashboard floods the audit log.

A request the gateway refused (status 4xx: no or bad token, missing role, over a limit, bad
body, no such route; not 499, a client that left, and never one relayed to an engine) is cheap
to send and costs the gateway a record. The first refusal of each status from a source in an interval gets its own
record, durable before its response as every record; the others of that interval are counted
and written as one summary record (`action` "refused.summary", `count`) when the interval ends.
An authenticated user's administrative change (a write to /admin) refused for what it asked (a bad
value, an unknown or conflicting object) always has its own record, with its object: who asked is
known and limited, and an auditor must see what each refused change was.
At most `max_sources` sources are tracked apart per interval; refusals from further sources are
summarised under source "*". So the log grows by at most two records per (source, status) per
interval, whatever the rate, and a record is at most a few hundred bytes (`cap_text`).

Monitoring reads (the services, host and pools a dashboard polls every few seconds) are
summarised the same way per user and action, over `audit.monitoring_interval_s`: the first read
of each interval has its own record, the rest one record of the same action with a count.

The head's cluster listener (serve.cluster_routes) summarises its refused joins and worker
requests the same way, per source and action, each summary keeping the last refusal's reason.

The counts of the current interval live in memory: a gateway that dies loses at most one
interval's counts, never a record of an admitted request.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from audit import AuditEvent, AuditUnavailable, AuditWriter

OTHER_SOURCES = "*"
MAX_TEXT_BYTES = 256


def refusable(status: int) -> bool:
    """Whether a response status is a refusal that may be summarised."""
    return 400 <= status < 500 and status != 499


def cap_text(text: str, limit: int = MAX_TEXT_BYTES) -> str:
    """`text` with control characters replaced and cut to at most `limit` UTF-8 bytes; a cut text
    ends with its full length and a SHA-256 prefix, so two long paths still tell apart."""
    clean = "".join(c if c.isprintable() and not 0xD800 <= ord(c) <= 0xDFFF else "?" for c in text)
    raw = clean.encode()
    if len(raw) <= limit:
        return clean
    tail = f"...[{len(text.encode('utf-8', 'surrogatepass'))} bytes sha256:" \
           f"{hashlib.sha256(text.encode('utf-8', 'surrogatepass')).hexdigest()[:16]}]"
    return raw[:limit - len(tail)].decode(errors="ignore") + tail


@dataclass
class _Count:
    last: AuditEvent
    count: int = 0


class Summaries:
    """Which events get their own record, and the rest gathered (thread-safe): per party (the
    event's `party_field`) and kind, the first event of each interval is written at once; the
    others are counted into one summary record (`summary_action`, else the event's own action,
    with `count`) due when the interval ends. At most `max_parties` parties are told apart per
    interval; further ones are gathered under party "*". A summary says no more of what its
    events held than its party, kind and count, unless `keep_last_error`: then its `error` is the
    last event's, after the count."""

    def __init__(self, interval_s: float, max_parties: int, *, party_field: str, summary_action: str | None,
                 keep_last_error: bool = False, forget: tuple[str, ...] = (),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._interval = interval_s
        self._max_parties = max_parties
        self._party_field = party_field
        self._summary_action = summary_action
        self._keep_last_error = keep_last_error
        self._forget = forget  # fields the events of one summary need not share: left out of it
        self._clock = clock
        self._lock = threading.Lock()
        self._window_ends = clock() + interval_s
        self._counts: dict[tuple[str, str | int], _Count] = {}
        self._parties: set[str] = set()
        self._due: list[AuditEvent] = []

    def first_of_interval(self, event: AuditEvent, kind: str | int) -> bool:
        """Whether `event` is written now; if not, it is counted into its interval's summary."""
        with self._lock:
            self._roll()
            party = getattr(event, self._party_field) or OTHER_SOURCES
            if party not in self._parties:
                if len(self._parties) >= self._max_parties:
                    party = OTHER_SOURCES
                self._parties.add(party)
            found = self._counts.get((party, kind))
            if found is None:
                self._counts[(party, kind)] = _Count(event)
                return True
            found.last, found.count = event, found.count + 1
            return False

    def due(self, *, all_now: bool = False) -> list[AuditEvent]:
        """Summary records of the intervals that have ended (with `all_now`, of the current one
        too); the caller writes them, and hands back with `retry` any it could not."""
        with self._lock:
            self._roll(force=all_now)
            due, self._due = self._due, []
            return due

    def retry(self, events: list[AuditEvent]) -> None:
        with self._lock:
            self._due[:0] = events

    def _roll(self, force: bool = False) -> None:
        now = self._clock()
        if now < self._window_ends and not force:
            return
        for (party, _), counted in self._counts.items():
            if counted.count:
                last = counted.last
                error = f"{counted.count} more; the last: {last.error}" if self._keep_last_error else None
                self._due.append(last.model_copy(update={
                    "action": self._summary_action or last.action, self._party_field: party,
                    "count": counted.count, "latency_ms": None, "prompt_hmac": None, "completion_hmac": None,
                    "params_hmac": None, "params": None, "prompt": None, "completion": None, "error": error,
                    **dict.fromkeys(self._forget)}))
        self._counts.clear()
        self._parties.clear()
        self._window_ends = now + self._interval


class Refusals(Summaries):
    """Refused requests, per source, status and user (summary action "refused.summary"): one
    user's refusals are never counted under another's name. What the refused requests asked for
    (path, object, model, key) differs from one to the next and is left out of the summary."""

    def __init__(self, interval_s: float, max_sources: int, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(interval_s, max_sources, party_field="source", summary_action="refused.summary",
                         forget=("resource", "target", "model", "key"), clock=clock)

    def own_record(self, event: AuditEvent, relayed: bool = False, change: bool = False) -> bool:
        """Whether `event` is written now. A request the engine saw (`relayed`) always has its
        own record, whatever the engine said; so has any that was not refused, and an authenticated
        user's administrative `change` refused for what it asked (not for who asked: 401, 403, 429),
        which an auditor must see with its object."""
        if relayed or not refusable(event.status):
            return True
        if change and event.username is not None and event.status not in (401, 403, 429):
            return True
        return self.first_of_interval(event, f"{event.status} {event.username or ''}")


def write_due(writer: AuditWriter, summaries: Summaries, *, all_now: bool = False) -> None:
    """Write the summary records that are due (with `all_now`, the current interval's too); those
    the log cannot take now are handed back, to be written once it is writable again."""
    due = summaries.due(all_now=all_now)
    for position, event in enumerate(due):
        try:
            writer.append(event)
        except AuditUnavailable:
            summaries.retry(due[position:])
            return
