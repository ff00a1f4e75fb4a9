"""Attacker pass over three day-one surfaces: live gateway limits (SIGHUP), per-key limit changes,
and the datasets admin routes. Each test is one attack; a failing one is a finding."""

from __future__ import annotations

import json
import os

import pytest
from pydantic import ValidationError

from appliance import api_keys, datasets, live_settings
from appliance.errors import Invalid
from appliance.home import Home
from appliance.settings import Settings
from serve.limits import RateLimiter
from serve.settings_reload import take_limits

USER = frozenset({"user"})


# --- 1. live limits reload -------------------------------------------------------------------

def _problem(home: Home) -> str | None:
    return live_settings.await_answer(home, "gateway", os.getpid(), "0" * 64)


def test_a_settings_file_not_in_utf8_changes_nothing_and_the_gateway_keeps_running(home: Home) -> None:
    """A stray Latin-1 byte (an editor's save) must not raise out of the SIGHUP handler: that
    would end the gateway's task group, i.e. take the gateway down, the very thing SIGHUP avoids."""
    home.settings_file.write_bytes(b"# caf\xe9\n[gateway.limits.user]\nmax_tokens = 10\n")
    limiter = RateLimiter(before := Settings().gateway.limits)
    take_limits(limiter, home)  # currently: UnicodeDecodeError escapes
    assert limiter.limits is before
    assert _problem(home) is not None


def test_an_integer_past_python_s_digit_limit_changes_nothing(home: Home) -> None:
    home.settings_file.write_text("[gateway.limits.user]\nrequests_per_minute = " + "9" * 5000 + "\n")
    limiter = RateLimiter(before := Settings().gateway.limits)
    take_limits(limiter, home)  # currently: ValueError (int max str digits) escapes tomllib
    assert limiter.limits is before
    assert _problem(home) is not None


def test_a_huge_limit_is_refused_rather_than_failing_every_request(home: Home) -> None:
    """tomllib reads integers of any size; 10**400 validates (gt=0 only), is answered as taken,
    then every request of that role fails with OverflowError (int / 60 in the limiter)."""
    home.settings_file.write_text("[gateway.limits.user]\nrequests_per_minute = 1" + "0" * 400 + "\n")
    limiter = RateLimiter(Settings().gateway.limits)
    take_limits(limiter, home)
    answer = live_settings.Taken.model_validate_json(live_settings.answer_file(home, "gateway").read_bytes())
    if answer.problem is None:  # answered as taken: a user's request must still be admitted
        limiter.admit("alice", USER).settle(0, 0)  # currently: OverflowError


@pytest.mark.parametrize("value", ["nan", "inf", "-5", "0", "[1, 2]", "{ a = 1 }", "1.5"])
def test_odd_limit_values_change_nothing(home: Home, value: str) -> None:
    home.settings_file.write_text(f"[gateway.limits.user]\nrequests_per_minute = {value}\n")
    limiter = RateLimiter(before := Settings().gateway.limits)
    take_limits(limiter, home)
    assert limiter.limits is before
    assert _problem(home) is not None


def test_limits_as_a_list_change_nothing(home: Home) -> None:
    home.settings_file.write_text("[gateway]\nlimits = [1, 2]\n")
    limiter = RateLimiter(before := Settings().gateway.limits)
    take_limits(limiter, home)
    assert limiter.limits is before


def test_an_answer_through_a_symlink_or_of_another_pid_is_not_believed(home: Home, tmp_path) -> None:
    forged = live_settings.Taken(pid=os.getpid(), digest="f" * 64).model_dump_json()
    elsewhere = tmp_path / "forged.json"
    elsewhere.write_text(forged)
    path = live_settings.answer_file(home, "gateway")
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.symlink_to(elsewhere)
    live_settings.ANSWER_TIMEOUT_S, saved = 0.3, live_settings.ANSWER_TIMEOUT_S
    try:
        assert live_settings.await_answer(home, "gateway", os.getpid(), "f" * 64) is not None
        path.unlink()
        path.write_text(live_settings.Taken(pid=os.getpid() + 1, digest="f" * 64).model_dump_json())
        assert live_settings.await_answer(home, "gateway", os.getpid(), "f" * 64) is not None
        path.write_text(json.dumps({"pid": os.getpid(), "digest": "f" * 64, "extra": 1}))
        assert live_settings.await_answer(home, "gateway", os.getpid(), "f" * 64) is not None
    finally:
        live_settings.ANSWER_TIMEOUT_S = saved


def test_the_run_directory_is_private(home: Home) -> None:
    assert os.stat(home.run).st_mode & 0o022 == 0


# --- 2. per-key limits -----------------------------------------------------------------------

@pytest.mark.parametrize("body", [
    '{"tokens_per_minute": true}', '{"tokens_per_minute": [5]}', '{"tokens_per_minute": 1e30}',
    '{"tokens_per_minute": -1}', '{"tokens_per_minute": 0}', '{"tokens_per_minute": "NaN"}',
    '{"models": "pool"}', '{"models": []}', '{"models": ["../x"]}', '{"owner": "bob", "models": null}',
    '{"tokens_per_minute": 5, "revoked": null}', '{}',
])
def test_odd_limit_bodies_are_refused(body: str) -> None:
    """`true` is taken as tokens_per_minute 1 (pydantic lax int): low, but a typo'd body silently
    throttles a key to 1 token a minute instead of being refused (422)."""
    with pytest.raises(ValidationError):
        api_keys.NewLimits.model_validate_json(body)


def _key(home: Home, owner: str, name: str) -> None:
    api_keys.create(home, api_keys.NewKey(name=name, owner=owner), owner_id=f"id-{owner}", created_by=owner)


@pytest.mark.parametrize("name", ["../bob/app", "bob/app", "app/..", "\uff41pp", "app\u200b", "x" * 65536, "APP"])
def test_a_name_reaches_no_other_key(home: Home, name: str) -> None:
    _key(home, "alice", "app")
    _key(home, "bob", "app")
    from appliance.errors import NotFound
    with pytest.raises(NotFound):
        api_keys.limit(home, "alice", name, api_keys.NewLimits(tokens_per_minute=5))
    assert api_keys.get(home, "bob", "app").tokens_per_minute is None


def test_a_user_cannot_name_another_owner() -> None:
    from serve.auth import Principal
    from serve.errors import AuthError
    from serve.routes.keys import _may_manage
    who = Principal(subject="s", username="alice", client="c", roles=frozenset({"user"}), token_id="t",
                    expires_at=0.0)
    with pytest.raises(AuthError):
        _may_manage(who, "bob")


# --- 3. datasets -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["..", "../x", "a/b", "a\\b", ".hidden", "x" * 65, "\u0430bc", "a\x00b",
                                  "ABC", "a b", "%2e%2e"])
def test_dataset_names_that_could_reach_elsewhere_are_refused(name: str) -> None:
    with pytest.raises(Invalid):
        datasets.check_name(name)
