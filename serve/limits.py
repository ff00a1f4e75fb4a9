"""Per-user rate limits: a request bucket and a token bucket per user, refilled continuously."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from appliance.settings import RoleLimits
from serve.errors import GatewayError


@dataclass
class Bucket:
    """A token bucket that may go negative (tokens are debited after the response)."""

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


class RateLimiter:
    """Requests and tokens per minute per user; the most generous of the user's roles applies."""

    def __init__(self, limits: dict[str, RoleLimits]) -> None:
        self._limits = limits
        self._buckets: dict[str, tuple[Bucket, Bucket]] = {}

    def _for(self, user: str, roles: frozenset[str]) -> tuple[Bucket, Bucket] | None:
        buckets = self._buckets.get(user)
        if buckets is None:
            mine = [self._limits[r] for r in roles if r in self._limits]
            if not mine:
                return None
            best = max(mine, key=lambda limit: (limit.requests_per_minute, limit.tokens_per_minute))
            now = time.monotonic()
            buckets = (Bucket(best.requests_per_minute, best.requests_per_minute / 60, now),
                       Bucket(best.tokens_per_minute, best.tokens_per_minute / 60, now))
            self._buckets[user] = buckets
        return buckets

    def admit(self, user: str, roles: frozenset[str]) -> None:
        """Take one request from the user's budget, or raise 429 with Retry-After."""
        buckets = self._for(user, roles)
        if buckets is None:
            return
        requests, tokens = buckets
        now = time.monotonic()
        requests.refill(now)
        tokens.refill(now)
        wait = max(requests.wait_s(1), tokens.wait_s(1))
        if wait > 0:
            raise GatewayError(429, f"rate limit exceeded for {user}; retry in {math.ceil(wait)}s",
                               type="rate_limit_error", code="rate_limit_exceeded",
                               headers={"Retry-After": str(math.ceil(wait))})
        requests.level -= 1

    def charge(self, user: str, tokens_used: int) -> None:
        """Debit the tokens a finished request used."""
        buckets = self._buckets.get(user)
        if buckets is not None:
            buckets[1].level -= tokens_used
