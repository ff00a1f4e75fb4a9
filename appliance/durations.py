"""Lengths of time as people type them: a whole number and one unit (`90s`, `15m`, `12h`, `30d`,
`52w`). The one grammar of every option that takes one (`keys create --expires-in`, the spans
of `audit --since` and `--until`); appliance.terminal.duration writes them back."""

from __future__ import annotations

import re
from datetime import timedelta

from appliance.errors import Invalid

FORMS = "a whole number and a unit s, m, h, d or w (90s, 15m, 12h, 30d, 52w)"

_DURATION = re.compile(r"([0-9]+)([smhdw])")  # ASCII digits: "１d" is no duration
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def is_duration(text: str) -> bool:
    """Whether `text` is written as a duration (its size is checked by `parse`)."""
    return _DURATION.fullmatch(text) is not None


def parse(text: str, *, name: str) -> timedelta:
    """The length of time `text` names; Invalid naming `name` (the option or field), the value and
    the accepted forms for anything else."""
    found = _DURATION.fullmatch(text)
    if found is None:
        raise Invalid(f"{name} {text!r} is not a duration: use {FORMS}")
    count, unit = found.groups()
    try:
        return timedelta(**{_UNITS[unit]: int(count)})
    except (ValueError, OverflowError) as exc:  # past timedelta's range, or too many digits for an int
        raise Invalid(f"{name} {text!r} is out of range: at most {timedelta.max.days}d") from exc
