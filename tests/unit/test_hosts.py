"""The head's host registry (appliance.hosts): one-time join tokens carrying the CA's fingerprint,
credentials kept as digests, refusals that say why and never echo a secret."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from appliance import hosts
from appliance.errors import Conflict, Invalid, NotFound
from appliance.home import Home

CA = "ab" * 32


def test_a_token_checked_but_not_spent_still_joins(home: Home) -> None:
    secret = hosts.parse_join_token(hosts.invite(home, "worker-1", 3600, CA)).secret
    hosts.check_token(home, "worker-1", secret)  # a join that fails after this leaves the token usable
    assert hosts.redeem(home, "worker-1", secret, "10.0.0.2")
    with pytest.raises(hosts.Refused, match="used already"):
        hosts.check_token(home, "worker-1", secret)


def test_a_token_joins_once_and_the_registry_keeps_only_digests(home: Home) -> None:
    token = hosts.invite(home, "worker-1", 3600, CA)
    parsed = hosts.parse_join_token(token)
    assert (parsed.name, parsed.ca_sha256) == ("worker-1", CA)
    credential = hosts.redeem(home, "worker-1", parsed.secret, "10.0.0.2")
    assert hosts.authenticate(home, "worker-1", credential).address == "10.0.0.2"
    stored = hosts.registry_path(home).read_text()
    assert parsed.secret not in stored and credential not in stored
    assert hosts.registry_path(home).stat().st_mode & 0o777 == 0o600
    with pytest.raises(hosts.Refused, match="host worker-1: its join token was used already"):
        hosts.redeem(home, "worker-1", parsed.secret, "10.0.0.2")
    with pytest.raises(Conflict, match="host worker-1 has joined already"):
        hosts.invite(home, "worker-1", 3600, CA)


def test_wrong_expired_unknown_and_revoked_are_refused(home: Home) -> None:
    secret = hosts.parse_join_token(hosts.invite(home, "worker-1", 60, CA)).secret
    with pytest.raises(hosts.Refused, match="host worker-1: wrong join token") as wrong:
        hosts.redeem(home, "worker-1", secret[::-1], "10.0.0.2")
    assert secret[::-1] not in str(wrong.value)
    with pytest.raises(hosts.Refused, match="its join token expired"):
        hosts.redeem(home, "worker-1", secret, "10.0.0.2", now=datetime.now(UTC) + timedelta(seconds=61))
    with pytest.raises(hosts.Refused, match="host worker-9 is not invited"):
        hosts.redeem(home, "worker-9", secret, "10.0.0.2")
    credential = hosts.redeem(home, "worker-1", secret, "10.0.0.2")
    with pytest.raises(hosts.Refused, match="unknown or revoked credential"):
        hosts.authenticate(home, "worker-1", credential + "x")
    hosts.remove(home, "worker-1")
    with pytest.raises(hosts.Refused, match="unknown or revoked credential"):
        hosts.authenticate(home, "worker-1", credential)
    with pytest.raises(NotFound, match="host worker-1 is not registered"):
        hosts.remove(home, "worker-1")


@pytest.mark.parametrize("token", ["", "ajt1.x.y", "jwt.a.b.c", "ajt1.Li4v.secret." + CA, "ajt1.d29ya2VyLTE.s.nothex"])
def test_malformed_tokens_are_refused_with_the_reason(token: str) -> None:
    with pytest.raises(Invalid, match="not a join token"):
        hosts.parse_join_token(token)


def test_a_refused_host_names_its_problem_and_a_damaged_registry_is_named(home: Home) -> None:
    secret = hosts.parse_join_token(hosts.invite(home, "worker-1", 60, CA)).secret
    credential = hosts.redeem(home, "worker-1", secret, "10.0.0.2")
    hosts.refuse(home, "worker-1", "/w/model.safetensors: SHA-256 differs from the head's")
    record = hosts.load(home).hosts["worker-1"]
    assert record.state == hosts.HostState.REFUSED and "model.safetensors" in (record.problem or "")
    with pytest.raises(hosts.Refused, match="host worker-1: refused"):
        hosts.authenticate(home, "worker-1", credential)  # a refused host's credential no longer works
    hosts.registry_path(home).write_text(json.dumps({"hosts": {"x": {"name": "../x"}}}))
    with pytest.raises(Exception, match="the host registry .*hosts.json is unreadable"):
        hosts.load(home)
