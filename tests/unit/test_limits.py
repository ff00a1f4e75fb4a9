"""Per-user token buckets: 429 with Retry-After when empty, refilled over time."""

import pytest

from appliance.settings import RoleLimits
from serve.errors import GatewayError
from serve.limits import RateLimiter

USER = frozenset({"user"})


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


def test_tokens_used_beyond_the_reservation_overdraw_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    monkeypatch.setattr("serve.limits.time.monotonic", lambda: clock[0])
    limiter = RateLimiter({"user": RoleLimits(requests_per_minute=100, tokens_per_minute=600)})
    limiter.admit("alice", USER).settle(1200, 0)  # the prompt was far longer than estimated
    with pytest.raises(GatewayError) as caught:
        limiter.admit("alice", USER)
    assert caught.value.headers["Retry-After"] == "61"


def test_parallel_requests_cannot_pass_a_budget_their_worst_case_exceeds() -> None:
    """Regression: 60 parallel streams all passed a 1,000 tokens/min budget, charged only after."""
    limiter = RateLimiter({"user": RoleLimits(requests_per_minute=1000, tokens_per_minute=1000)})
    admitted, refused = [], []
    for _ in range(60):
        try:
            admitted.append(limiter.admit("alice", USER, prompt_tokens=10, completion_tokens=90))
        except GatewayError as exc:
            refused.append(exc)
    assert len(admitted) == 10 and {exc.status for exc in refused} == {429}
    admitted[0].settle(10, 5)  # used 15 of its 100: 85 come back
    limiter.admit("alice", USER, prompt_tokens=10, completion_tokens=70)
    with pytest.raises(GatewayError):
        limiter.admit("alice", USER, prompt_tokens=10, completion_tokens=70)


def test_a_request_larger_than_the_whole_budget_is_a_400_naming_max_tokens() -> None:
    limiter = RateLimiter({"user": RoleLimits(tokens_per_minute=1000)})
    with pytest.raises(GatewayError) as caught:
        limiter.admit("alice", USER, prompt_tokens=10, completion_tokens=2000)
    assert caught.value.status == 400 and caught.value.param == "max_tokens"


def test_concurrent_requests_per_user_are_capped_and_freed_when_settled() -> None:
    limiter = RateLimiter({"user": RoleLimits(max_concurrent=2)})
    first, _ = limiter.admit("alice", USER), limiter.admit("alice", USER)
    with pytest.raises(GatewayError) as caught:
        limiter.admit("alice", USER)
    assert caught.value.status == 429 and caught.value.code == "concurrency_limit_exceeded"
    limiter.admit("bob", USER)  # per user
    first.settle(None, 3)
    first.settle(None, 3)  # settling twice frees one slot, once
    limiter.admit("alice", USER)
    with pytest.raises(GatewayError):
        limiter.admit("alice", USER)


def test_a_client_that_left_is_charged_its_prompt_estimate_and_what_was_produced(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    monkeypatch.setattr("serve.limits.time.monotonic", lambda: clock[0])
    limiter = RateLimiter({"user": RoleLimits(tokens_per_minute=1000)})
    limiter.admit("alice", USER, prompt_tokens=300, completion_tokens=600).settle(None, 200)
    limiter.admit("alice", USER, prompt_tokens=0, completion_tokens=500)  # 1000 - 500 left
    with pytest.raises(GatewayError):
        limiter.admit("alice", USER, prompt_tokens=0, completion_tokens=1)


def test_most_generous_role_applies_and_unlisted_roles_are_unlimited(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("serve.limits.time.monotonic", lambda: 1000.0)  # no refill during the test
    limiter = RateLimiter({"user": RoleLimits(requests_per_minute=1), "admin": RoleLimits(requests_per_minute=5)})
    limiter.admit("alice", USER)
    with pytest.raises(GatewayError):  # role `user` alone: one a minute
        limiter.admit("alice", USER)
    # user and admin: admin's five apply, not user's one (nor no limit at all).
    admitted = [limiter.admit("root", frozenset({"user", "admin"})) for _ in range(5)]
    assert all(a.limiter is limiter for a in admitted)
    with pytest.raises(GatewayError) as caught:
        limiter.admit("root", frozenset({"user", "admin"}))
    assert caught.value.status == 429
    # No listed role: never counted, never refused.
    assert limiter.limits_for(frozenset({"auditor"})) is None
    unlimited = [limiter.admit("svc", frozenset({"auditor"}), completion_tokens=10**9) for _ in range(100)]
    assert all(a.limiter is None for a in unlimited)
