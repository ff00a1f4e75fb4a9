"""Per-user limits: a request bucket and a token bucket per user, refilled continuously, and a cap
on the requests a user has in flight; and per-source attempts at the published login endpoints.

A request reserves its worst case against the token bucket when it is admitted (its prompt, as
estimated, plus max_tokens x n) and is settled when it ends: the tokens it really used are
charged and the rest refunded. Without the reservation, any number of parallel requests would
pass a budget that is only debited after they finish.
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from appliance.settings import RoleLimits
from serve.errors import GatewayError

# An API key's own budget counts tokens; its requests and concurrency are its owner's to limit.
KEY_REQUESTS_PER_MINUTE = 1_000_000
KEY_MAX_CONCURRENT = 1_000_000


@dataclass
class Bucket:
    """A token bucket that may go negative (a request may use more than it reserved)."""

    capacity: float
    per_second: float
    stamp: float
    level: float = field(init=False)

    def __post_init__(self) -> None:
        self.level = self.capacity

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.per_second)
        self.stamp = now

    def wait_s(self, need: float) -> float:
        """Seconds until `need` is available (0 if it is)."""
        return max(0.0, (need - self.level) / self.per_second)


@dataclass
class _User:
    limits: RoleLimits
    requests: Bucket
    tokens: Bucket
    in_flight: int = 0


@dataclass
class Admission:
    """An admitted request's hold on its user's budget: `reserved` tokens and one in-flight slot,
    until `settle` charges what it used (once; later calls do nothing)."""

    limiter: RateLimiter | None
    user: str
    reserved: int
    prompt_estimate: int
    settled: bool = False
    also: Admission | None = None  # a second budget held with this one (an API key's), settled with it

    def settle(self, prompt_tokens: int | None, completion_tokens: int) -> None:
        """Charge the tokens used (prompt None: not known, the estimate is charged), refund the
        rest of the reservation and free the in-flight slot."""
        if self.settled:
            return
        self.settled = True
        if self.limiter is not None:
            used = (self.prompt_estimate if prompt_tokens is None else prompt_tokens) + completion_tokens
            self.limiter._release(self.user, self.reserved - used)
        if self.also is not None:
            self.also.settle(prompt_tokens, completion_tokens)

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, *exc: object) -> None:
        self.settle(0, 0)


class RateLimiter:
    """Per-user limits; the most generous of the user's roles applies, and a user none of whose
    roles is listed is not limited. The limits may change while the gateway runs (`reload`, an API
    key's own budget): a user's next request is held to them, with what it used and has in flight
    kept."""

    def __init__(self, limits: dict[str, RoleLimits]) -> None:
        self._limits = limits
        self._users: dict[str, _User] = {}

    @property
    def limits(self) -> dict[str, RoleLimits]:
        return self._limits

    def reload(self, limits: dict[str, RoleLimits]) -> None:
        """Hold every user to `limits` from their next request on (`gateway.limits` taken live)."""
        self._limits = limits

    def limits_for(self, roles: frozenset[str]) -> RoleLimits | None:
        """The limits of the most generous role listed, or None."""
        mine = [self._limits[r] for r in roles if r in self._limits]
        if not mine:
            return None
        return max(mine, key=lambda limit: (limit.requests_per_minute, limit.tokens_per_minute))

    def _for(self, user: str, best: RoleLimits | None) -> _User | None:
        state = self._users.get(user)
        if state is not None and state.limits != best:
            if best is None and state.in_flight == 0:
                del self._users[user]  # no longer limited; nothing of it is held
                return None
            if best is not None:
                _hold_to(state, best)
        if state is None:
            if best is None:
                return None
            now = time.monotonic()
            state = _User(best, Bucket(best.requests_per_minute, best.requests_per_minute / 60, now),
                          Bucket(best.tokens_per_minute, best.tokens_per_minute / 60, now))
            self._users[user] = state
        return state

    def admit(self, user: str, roles: frozenset[str], *, prompt_tokens: int = 0,
              completion_tokens: int = 0) -> Admission:
        """Take one request and the worst case of its tokens from the user's budget and an
        in-flight slot; raise 429 with Retry-After when any is short, 400 when the request could
        never fit the budget."""
        return self._admit(user, self._for(user, self.limits_for(roles)), prompt_tokens, completion_tokens)

    def admit_key(self, name: str, tokens_per_minute: int, *, prompt_tokens: int, completion_tokens: int) -> Admission:
        """The same against an API key's own token budget, held beside its owner's."""
        budget = RoleLimits(tokens_per_minute=tokens_per_minute, requests_per_minute=KEY_REQUESTS_PER_MINUTE,
                            max_concurrent=KEY_MAX_CONCURRENT)
        return self._admit(f"API key {name}", self._for(f"API key {name}", budget), prompt_tokens, completion_tokens)

    def _admit(self, user: str, state: _User | None, prompt_tokens: int, completion_tokens: int) -> Admission:
        reserve = prompt_tokens + completion_tokens
        if state is None:
            return Admission(None, user, reserve, prompt_tokens)
        if reserve > state.tokens.capacity:
            raise GatewayError(400, f"this request may use {reserve} tokens (prompt and max_tokens x n), more "
                               f"than {user}'s budget of {int(state.tokens.capacity)} a minute; ask for fewer",
                               code="exceeds_token_budget", param="max_tokens")
        if state.in_flight >= state.limits.max_concurrent:
            raise GatewayError(429, f"{user} already has {state.in_flight} requests in flight (the most "
                               "allowed); retry when one ends", type="rate_limit_error",
                               code="concurrency_limit_exceeded", headers={"Retry-After": "1"})
        now = time.monotonic()
        state.requests.refill(now)
        state.tokens.refill(now)
        wait = max(state.requests.wait_s(1), state.tokens.wait_s(max(1, reserve)))
        if wait > 0:
            raise GatewayError(429, f"rate limit exceeded for {user}; retry in {math.ceil(wait)}s",
                               type="rate_limit_error", code="rate_limit_exceeded",
                               headers={"Retry-After": str(math.ceil(wait))})
        state.requests.level -= 1
        state.tokens.level -= reserve
        state.in_flight += 1
        return Admission(self, user, reserve, prompt_tokens)

    def _release(self, user: str, refund: float) -> None:
        state = self._users[user]
        state.in_flight -= 1
        state.tokens.level = min(state.tokens.capacity, state.tokens.level + refund)


def _hold_to(state: _User, limits: RoleLimits) -> None:
    """A user's buckets resized to new limits, keeping what the user has used of them: a minute's
    budget lowered from 10 to 4 requests after 3 leaves 1, raised to 60 leaves 57."""
    now = time.monotonic()
    for bucket, per_minute in ((state.requests, limits.requests_per_minute), (state.tokens, limits.tokens_per_minute)):
        bucket.refill(now)
        bucket.level = min(per_minute, bucket.level + per_minute - bucket.capacity)
        bucket.capacity, bucket.per_second = per_minute, per_minute / 60
    state.limits = limits


# Sources told apart at once by a SourceThrottle; past it, new sources share their network's bucket
# (as many networks again), and past those one bucket.
MAX_THROTTLED_SOURCES = 10_000
OTHER_SOURCES = "*"
# What one client owns: an IPv6 host is given a /64 (SLAAC, privacy addresses), so a bucket per
# IPv6 address would give it 2**64 buckets. A full table's newcomers share a bucket per IPv4 /24 or
# IPv6 /48 (one site's allocation), so one site filling the table locks out only itself.
IPV6_CLIENT_PREFIX = 64
IPV4_SITE_PREFIX = 24
IPV6_SITE_PREFIX = 48


def source_of(host: str) -> str:
    """The throttled source that the peer address `host` belongs to: an IPv4 address (however it
    is written: IPv4-mapped, 6to4 or Teredo IPv6 name the IPv4 host behind them), an IPv6 /64, or
    `host` itself when it is no IP address."""
    address = _address(host)
    if address is None:
        return host
    if isinstance(address, ipaddress.IPv4Address):
        return str(address)
    return str(_network(address, IPV6_CLIENT_PREFIX))


def site_of(host: str) -> str:
    """The wider network `host` belongs to (IPv4 /24, IPv6 /48), or OTHER_SOURCES."""
    address = _address(host)
    if address is None:
        return OTHER_SOURCES
    prefix = IPV4_SITE_PREFIX if isinstance(address, ipaddress.IPv4Address) else IPV6_SITE_PREFIX
    return str(_network(address, prefix))


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour or (address.teredo[1] if address.teredo else None)
        if embedded is not None:
            return embedded
    return address


def _network(address: ipaddress.IPv4Address | ipaddress.IPv6Address,
             prefix: int) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    # From the address's integer: a scoped IPv6 address (fe80::1%eth0) has no network of its own.
    bits = address.max_prefixlen - prefix
    return ipaddress.ip_network((int(address) >> bits << bits, prefix))


class SourceThrottle:
    """Attempts per source (the published login endpoints; serve.limits.source_of): a bucket of
    `burst` attempts each, refilled at `per_minute`. Keycloak's lockout is per account, so without
    this anyone who reaches the gateway guesses as fast as Keycloak answers. A source whose bucket
    is full again is forgotten; past `max_sources` sources with attempts still counting, a further
    source shares its site's bucket (site_of), and past `max_sources` sites one bucket: many
    addresses neither grow memory without end nor escape the throttle, and one site filling the
    table does not throttle the sources of others."""

    def __init__(self, per_minute: float, burst: int, *, max_sources: int = MAX_THROTTLED_SOURCES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._per_second = per_minute / 60
        self._burst = burst
        self._max_sources = max_sources
        self._clock = clock
        self._sources: dict[str, Bucket] = {}
        self._sites: dict[str, Bucket] = {}
        self._scanned = -math.inf

    def take(self, host: str) -> float:
        """Take one attempt from the bucket of the source `host` (a peer address) belongs to: 0 if it
        had one, else the seconds until it will (nothing is taken)."""
        now = self._clock()
        source = source_of(host)
        bucket = self._sources.get(source)
        if bucket is None:
            if len(self._sources) >= self._max_sources and now - self._scanned >= 1:
                self._forget_full(now)  # at most once a second: a pass walks every source
            if len(self._sources) < self._max_sources:
                bucket = self._sources[source] = Bucket(self._burst, self._per_second, now)
            else:
                bucket = self._site_bucket(site_of(host), now)
        bucket.refill(now)
        wait = bucket.wait_s(1)
        if wait == 0:
            bucket.level -= 1
        return wait

    def _site_bucket(self, site: str, now: float) -> Bucket:
        bucket = self._sites.get(site)
        if bucket is None:
            if len(self._sites) >= self._max_sources:
                site = OTHER_SOURCES
                bucket = self._sites.get(site)
            if bucket is None:
                bucket = self._sites[site] = Bucket(self._burst, self._per_second, now)
        return bucket

    def _forget_full(self, now: float) -> None:
        self._scanned = now
        for table in (self._sources, self._sites):
            for source, bucket in list(table.items()):
                bucket.refill(now)
                if bucket.level >= bucket.capacity:
                    del table[source]
