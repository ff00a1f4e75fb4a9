"""Limits taken while the gateway runs: a user is held to new limits from their next request on,
with what they used and have in flight kept; the gateway answers SIGHUP by reading the settings
file again (a file that does not validate changes nothing, and the answer says why)."""

from __future__ import annotations

import os
import signal

import anyio
import pytest

from appliance import live_settings
from appliance.home import Home
from appliance.settings import RoleLimits, Settings
from serve.errors import GatewayError
from serve.limits import RateLimiter
from serve.settings_reload import take_limits, take_settings_on_hangup

USER = frozenset({"user"})


def test_lower_limits_hold_a_user_from_the_next_request_keeping_what_was_used(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("serve.limits.time.monotonic", lambda: 100.0)
    limiter = RateLimiter({"user": RoleLimits(requests_per_minute=10, tokens_per_minute=1000, max_concurrent=4)})
    held = [limiter.admit("alice", USER) for _ in range(3)]
    limiter.reload({"user": RoleLimits(requests_per_minute=10, tokens_per_minute=1000, max_concurrent=2)})
    with pytest.raises(GatewayError, match="already has 3 requests in flight"):
        limiter.admit("alice", USER)
    for admission in held:
        admission.settle(0, 0)
    limiter.reload({"user": RoleLimits(requests_per_minute=4, tokens_per_minute=1000)})
    limiter.admit("alice", USER)  # 3 of the old 10 used: 1 of the new 4 is left
    with pytest.raises(GatewayError, match="rate limit exceeded"):
        limiter.admit("alice", USER)


def test_a_higher_limit_fills_at_its_new_rate_and_a_role_no_longer_limited_is_free(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    monkeypatch.setattr("serve.limits.time.monotonic", lambda: clock[0])
    limiter = RateLimiter({"user": RoleLimits(requests_per_minute=1, tokens_per_minute=1000)})
    limiter.admit("alice", USER).settle(0, 0)
    limiter.reload({"user": RoleLimits(requests_per_minute=60, tokens_per_minute=1000)})
    for _ in range(59):  # 1 of 60 used
        limiter.admit("alice", USER).settle(0, 0)
    with pytest.raises(GatewayError, match="retry in 1s"):
        limiter.admit("alice", USER)
    clock[0] += 1  # it refills at its new rate, 1 a second
    limiter.admit("alice", USER).settle(0, 0)
    limiter.reload({})
    for _ in range(100):
        limiter.admit("alice", USER).settle(0, 0)


def test_a_key_s_own_budget_follows_its_tokens_per_minute() -> None:
    limiter = RateLimiter({})
    limiter.admit_key("alice/app", 1000, prompt_tokens=600, completion_tokens=0).settle(600, 0)
    with pytest.raises(GatewayError, match="rate limit exceeded"):
        limiter.admit_key("alice/app", 500, prompt_tokens=10, completion_tokens=0)


def test_the_settings_file_s_limits_are_taken_and_answered(home: Home) -> None:
    home.settings_file.write_text("[gateway.limits.user]\nmax_tokens = 10\n")
    limiter = RateLimiter(Settings().gateway.limits)
    take_limits(limiter, home)
    assert limiter.limits["user"].max_tokens == 10 and "admin" in limiter.limits
    expected = live_settings.digest("gateway", Settings.model_validate(
        {"gateway": {"limits": {"user": {"max_tokens": 10}}}}).comparable())
    assert live_settings.await_answer(home, "gateway", os.getpid(), expected) is None


def test_a_settings_file_that_does_not_validate_changes_nothing_and_says_why(home: Home) -> None:
    home.settings_file.write_text("[gateway.limits.user]\nmax_tokens = -1\n")
    limiter = RateLimiter(before := Settings().gateway.limits)
    take_limits(limiter, home)
    assert limiter.limits is before
    problem = live_settings.await_answer(home, "gateway", os.getpid(), "0" * 64)
    assert problem is not None and "max_tokens" in problem


def test_sighup_is_heard_by_the_running_gateway(home: Home) -> None:
    home.settings_file.write_text("[gateway.limits.user]\nmax_concurrent = 3\n")
    limiter = RateLimiter(Settings().gateway.limits)

    async def hang_up_then_stop() -> None:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(take_settings_on_hangup, limiter, home)
            await anyio.sleep(0.1)
            os.kill(os.getpid(), signal.SIGHUP)
            with anyio.fail_after(5):
                while not live_settings.answer_file(home, "gateway").exists():
                    await anyio.sleep(0.02)
            tasks.cancel_scope.cancel()

    anyio.run(hang_up_then_stop)
    assert limiter.limits["user"].max_concurrent == 3
