"""The per-source throttle of the published login endpoints (serve.limits.SourceThrottle): each
source has its own bucket, refilled over time; a source refused takes nothing; memory stays bounded
whatever the number of sources, and no source escapes the throttle by being one too many; an IPv6
/64 is one source and an IPv4 address is one however it is written, and one site filling the table
throttles only itself."""

from __future__ import annotations

import ipaddress
from typing import Any

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
    assert len(throttle._sources) <= 3 and len(throttle._sites) <= 3 + 1  # and the shared bucket


def test_past_max_sources_new_sources_share_one_bucket_and_full_ones_are_forgotten() -> None:
    clock = Clock()
    throttle = SourceThrottle(per_minute=60, burst=2, max_sources=2, clock=clock)
    assert throttle.take("a") == 0 and throttle.take("b") == 0
    assert throttle.take("c") == 0 and throttle.take("d") == 0  # c and d share the overflow bucket
    assert throttle.take("e") > 0, "the shared bucket is spent: one more source is no way around it"
    clock.now += 5  # every bucket full again: forgotten when room is needed
    assert throttle.take("f") == 0 and set(throttle._sources) == {"f"}


IPV6_HOSTS = st.integers(0, 2**64 - 1)


@given(st.integers(0, 2**64 - 1), st.lists(IPV6_HOSTS, min_size=5, max_size=40, unique=True))
def test_the_addresses_of_one_ipv6_64_are_one_source(prefix: int, hosts: list[int]) -> None:
    # One host owns a /64: a bucket per address would give it 2**64 buckets.
    throttle = SourceThrottle(per_minute=6, burst=4, clock=Clock())
    admitted = [throttle.take(str(ipaddress.IPv6Address(prefix << 64 | host))) == 0 for host in hosts]
    assert admitted == [True] * 4 + [False] * (len(hosts) - 4)


@pytest.mark.parametrize("written", [
    "::ffff:198.51.100.7", "::ffff:c633:6407", "::FFFF:198.51.100.7", "2002:c633:6407::1", "2002:c633:6407:9::42",
])
def test_one_ipv4_address_however_written_is_one_source(written: str) -> None:
    throttle = SourceThrottle(per_minute=6, burst=2, clock=Clock())
    assert throttle.take("198.51.100.7") == 0 and throttle.take(written) == 0
    assert throttle.take(written) > 0 and throttle.take("198.51.100.7") > 0


@pytest.mark.parametrize("attacker", [
    lambda n: f"2001:db8:0:{n:x}::1",  # one site's /48 of /64s
    lambda n: f"203.0.113.{n % 256}",  # one /24
])
def test_one_site_filling_the_table_throttles_only_itself(attacker: Any) -> None:
    clock = Clock()
    throttle = SourceThrottle(per_minute=6, burst=2, max_sources=50, clock=clock)
    for n in range(500):  # spends its own and then its site's shared bucket
        throttle.take(attacker(n))
    assert throttle.take(attacker(501)) > 0, "the site's shared bucket is spent"
    assert len(throttle._sources) <= 50 and len(throttle._sites) <= 51
    for others in ("192.0.2.10", "198.18.7.1", "2001:db8:1::5", "::ffff:198.51.100.1"):  # four other sites
        assert [throttle.take(others) for _ in range(2)] == [0, 0], f"{others} is locked out by another site"
        assert throttle.take(others) > 0


@given(st.lists(st.tuples(st.integers(0, 2**128 - 1), st.floats(0, 5)), max_size=300))
def test_memory_stays_bounded_whatever_the_addresses(attempts: list[tuple[int, float]]) -> None:
    clock = Clock()
    throttle = SourceThrottle(per_minute=6, burst=2, max_sources=8, clock=clock)
    for address, pause in attempts:
        clock.now += pause
        throttle.take(str(ipaddress.IPv6Address(address)))
        assert len(throttle._sources) <= 8 and len(throttle._sites) <= 9
