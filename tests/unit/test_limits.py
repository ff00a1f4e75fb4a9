"""Per-user token buckets: 429 with Retry-After when empty, refilled over time."""

import pytest

from appliance.settings import RoleLimits
from serve.errors import GatewayError
from serve.limits import RateLimiter


def test_requests_bucket_empties_then_refills(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr("serve.limits.time.monotonic", lambda: clock[0])
    limiter = RateLimiter({"user": RoleLimits(requests_per_minute=3, tokens_per_minute=1000)})
    for _ in range(3):
        limiter.admit("alice", frozenset({"user"}))
    with pytest.raises(GatewayError) as caught:
        limiter.admit("alice", frozenset({"user"}))
    assert caught.value.status == 429 and caught.value.headers["Retry-After"] == "20"
    limiter.admit("bob", frozenset({"user"}))  # buckets are per user
    clock[0] += 20
    limiter.admit("alice", frozenset({"user"}))


def test_tokens_are_charged_after_the_fact(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    monkeypatch.setattr("serve.limits.time.monotonic", lambda: clock[0])
    limiter = RateLimiter({"user": RoleLimits(requests_per_minute=100, tokens_per_minute=600)})
    limiter.admit("alice", frozenset({"user"}))
    limiter.charge("alice", 1200)  # one long answer overdraws the budget
    with pytest.raises(GatewayError) as caught:
        limiter.admit("alice", frozenset({"user"}))
    assert caught.value.headers["Retry-After"] == "61"


def test_most_generous_role_applies_and_unlisted_roles_are_unlimited() -> None:
    limiter = RateLimiter({"user": RoleLimits(requests_per_minute=1),
                           "admin": RoleLimits(requests_per_minute=1000)})
    for _ in range(10):
        limiter.admit("root", frozenset({"user", "admin"}))
        limiter.admit("svc", frozenset({"auditor"}))
