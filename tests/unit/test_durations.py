"""One duration grammar (appliance.durations) for every option that takes one: `keys create
--expires-in` and the spans of `audit --since`/`--until` accept the same forms and refuse the rest
with the same words, naming the option and the value."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from appliance import durations
from appliance.api_keys import expiry
from appliance.errors import Invalid
from audit.times import parse_instant

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(("text", "length"), [
    ("90s", timedelta(seconds=90)), ("15m", timedelta(minutes=15)), ("12h", timedelta(hours=12)),
    ("30d", timedelta(days=30)), ("52w", timedelta(weeks=52)), ("0s", timedelta(0)), ("007m", timedelta(minutes=7)),
])
def test_every_option_takes_the_same_forms(text: str, length: timedelta) -> None:
    assert durations.parse(text, name="--x") == length
    assert parse_instant(text, name="--since", now=NOW) == NOW - length
    if length:
        assert expiry(text, NOW, name="--expires-in") == NOW + length


@pytest.mark.parametrize("text", ["", "1", "h", "1y", "1H", "-1h", "1.5h", " 1h", "1h ", "1d\n", "１d", "1h30m"])
def test_anything_else_is_refused_naming_the_option_and_value(text: str) -> None:
    words = f"{text!r} is not a duration: use a whole number and a unit s, m, h, d or w (90s, 15m, 12h, 30d, 52w)"
    with pytest.raises(Invalid) as refused:
        durations.parse(text, name="--x")
    assert refused.value.message == f"--x {words}"
    with pytest.raises(Invalid) as refused_key:
        expiry(text, NOW, name="--expires-in")
    assert refused_key.value.message == f"--expires-in {words}", "the keys' option says what the parser says"


@pytest.mark.parametrize("text", ["99999999999999w", "9" * 5000 + "s"])
def test_a_duration_too_long_for_any_clock_is_out_of_range_not_a_crash(text: str) -> None:
    with pytest.raises(Invalid) as refused:
        durations.parse(text, name="--x")
    assert refused.value.message == f"--x {text!r} is out of range: at most 999999999d", "in the option's terms"


def test_a_key_needs_a_lifetime_longer_than_zero_and_at_most_ten_years() -> None:
    assert expiry(None, NOW) is None, "unset: until revoked"
    for text, says in (("0h", "'0h' is no lifetime: give one longer than zero"),
                       ("3654d", "'3654d' is longer than ten years")):
        with pytest.raises(Invalid) as refused:
            expiry(text, NOW, name="--expires-in")
        assert refused.value.message == f"--expires-in {says}"
    assert expiry("3600s", NOW) == NOW + timedelta(hours=1), "seconds and minutes as for audit --since"
