"""The per-source throttle of the published login endpoints (serve.limits.SourceThrottle): each
source has its own bucket, refilled over time; a source refused takes nothing; memory stays bounded
whatever the number of sources, and no source escapes the throttle by being one too many."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from serve.limits import SourceThrottle


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_then_the_rate_with_retry_after() -> None:
    clock = Clock()
    throttle = SourceThrottle(per_minute=6, burst=3, clock=clock)
    assert [throttle.take("10.0.0.1") for _ in range(3)] == [0, 0, 0]
    assert throttle.take("10.0.0.1") == pytest.approx(10.0)  # one attempt every 10 s
    clock.now += 4
    assert throttle.take("10.0.0.1") == pytest.approx(6.0)  # a refused attempt took nothing
    clock.now += 6
    assert throttle.take("10.0.0.1") == 0
    assert throttle.take("10.0.0.2") == 0, "another source has its own bucket"


@given(st.lists(st.tuples(st.integers(0, 5), st.floats(0, 30)), max_size=200))
def test_no_source_ever_gets_more_than_burst_plus_refill(attempts: list[tuple[int, float]]) -> None:
    clock = Clock()
    start = clock.now
    throttle = SourceThrottle(per_minute=12, burst=4, max_sources=3, clock=clock)
    admitted: dict[str, int] = {}
    for source, pause in attempts:
        clock.now += pause
        if throttle.take(f"10.0.0.{source}") == 0:
            admitted[f"10.0.0.{source}"] = admitted.get(f"10.0.0.{source}", 0) + 1
    ceiling = 4 + (clock.now - start) * 12 / 60
    assert all(count <= ceiling + 1e-9 for count in admitted.values()), admitted
    assert len(throttle._sources) <= 3 + 1  # and the shared bucket


def test_past_max_sources_new_sources_share_one_bucket_and_full_ones_are_forgotten() -> None:
    clock = Clock()
    throttle = SourceThrottle(per_minute=60, burst=2, max_sources=2, clock=clock)
    assert throttle.take("a") == 0 and throttle.take("b") == 0
    assert throttle.take("c") == 0 and throttle.take("d") == 0  # c and d share the overflow bucket
    assert throttle.take("e") > 0, "the shared bucket is spent: one more source is no way around it"
    clock.now += 5  # every bucket full again: forgotten when room is needed
    assert throttle.take("f") == 0 and set(throttle._sources) == {"f"}
