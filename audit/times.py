"""Times for audit queries: `--since`/`--until` values and records' `time` fields as instants.

A query time is an RFC 3339 / ISO 8601 time with `Z` or an offset (fractional seconds optional),
a bare date (its UTC midnight) or a span before now (`90s`, `15m`, `1h`, `2d`, `1w`: the
appliance's one duration grammar, appliance.durations). Records are
compared as instants, never as text: as text `2026-12-01T10:00:00Z` sorts after every record of
that second, and a time with an offset sorts anywhere.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, date, datetime, time
from typing import Any

from appliance import durations
from appliance.errors import Invalid, StateError

FORMS = ("an RFC 3339 time with Z or an offset (2026-12-01T09:30:00Z, 2026-12-01T10:30:00.5+01:00), "
         f"a date (2026-12-01, its UTC midnight) or a span before now, {durations.FORMS}")

_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
# Seconds and their fraction may be left out, as ISO 8601 allows; the zone may not (see below).
_TIME = re.compile(r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?P<zone>[Zz]|[+-]\d{2}(?::?\d{2})?)?")


def parse_instant(text: str, *, name: str, now: datetime | None = None) -> datetime:
    """The UTC instant `text` names (a span counts back from `now`, default the clock's); raises
    Invalid, naming `name` (the option or parameter) and the accepted forms, for anything else."""
    if durations.is_duration(text):
        span = durations.parse(text, name=name)
        start = now or datetime.now(UTC)
        return _checked(text, name, lambda: start - span)
    if _DATE.fullmatch(text):
        return _checked(text, name, lambda: datetime.combine(date.fromisoformat(text), time(), UTC))
    stamp = _TIME.fullmatch(text)
    if stamp is None:
        raise Invalid(f"{name} {text!r} is not a time: use {FORMS}")
    if stamp["zone"] is None:
        # A time without a zone is local to someone: guessing UTC would silently shift the range.
        raise Invalid(f"{name} {text!r} has no time zone: add Z for UTC or an offset such as +01:00")
    return _checked(text, name, lambda: datetime.fromisoformat(text.upper()).astimezone(UTC))


def record_instant(record: dict[str, Any]) -> datetime:
    """The instant a record was written: its `time`, as the writer writes it (UTC, Z)."""
    written = record.get("time")
    try:
        parsed = datetime.fromisoformat(written) if isinstance(written, str) else None
        if parsed is not None and parsed.tzinfo is not None:
            return parsed.astimezone(UTC)
    except (ValueError, OverflowError):
        pass  # said below, with the record's sequence number
    raise StateError(f"audit record seq {record.get('seq')} has no readable time: {written!r}",
                     hint="run `appliance audit verify`")


def _checked(text: str, name: str, make: Callable[[], datetime]) -> datetime:
    """`make()`, with a calendar or range fault (month 13, an offset of 25 hours, a span back
    past year 1) as Invalid naming the option."""
    try:
        return make()
    except (ValueError, OverflowError) as exc:
        raise Invalid(f"{name} {text!r} is out of range: {exc}") from exc
