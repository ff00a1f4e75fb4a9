"""Where the CLI works: this host's appliance, or a remote one chosen with `appliance token
--gateway`: what the gateway's discovery must say, what is kept (0700/0600) and how a damaged or
foreign profile is refused."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import httpx
import pytest

from appliance import connection as connections
from appliance import login
from appliance.errors import Invalid, Unavailable
from appliance.home import Home
from appliance.settings import Settings
from tests.support.tokens import admin_token

GATEWAY = "https://llm.bank.test:8443"
FOUND = {"issuer": f"{GATEWAY}/realms/appliance", "realm_path": "/realms/appliance", "client_id": "appliance-cli",
         "published": True}


def answering(monkeypatch: pytest.MonkeyPatch, body: Any, status: int = 200) -> list[str]:
    asked: list[str] = []

    def get(url: str, **_: Any) -> httpx.Response:
        asked.append(url)
        return httpx.Response(status, json=body, request=httpx.Request("GET", url))

    monkeypatch.setattr(connections.httpx, "get", get)
    return asked


def test_a_remote_appliance_is_discovered_remembered_and_forgotten(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path, user_config: Path) -> None:
    asked = answering(monkeypatch, FOUND)
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    remote = connections.discover(f"{GATEWAY}/", None)
    assert asked == [f"{GATEWAY}/.well-known/appliance"]
    assert (remote.gateway, remote.realm_url, remote.issuer, remote.remote) == (
        GATEWAY, f"{GATEWAY}/realms/appliance", FOUND["issuer"], True)
    login.save(remote, admin_token())
    connections.remember(remote, None)
    directory = user_config / "appliance"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE((directory / "remote.json").stat().st_mode) == 0o600
    assert stat.S_IMODE(remote.token_cache.stat().st_mode) == 0o600
    current = connections.current(lambda: pytest.fail("the local appliance is not asked for"))
    assert current.gateway == GATEWAY and login.cached_login(current).username == "admin"
    assert connections.forget() is True
    local = connections.current(lambda: (Settings(), Home(tmp_path / "h")))
    assert not local.remote and local.gateway == "http://127.0.0.1:8080"
    assert connections.forget() is False


@pytest.mark.parametrize("url", ["http://llm.bank.test:8443", "https://llm.bank.test/realms/x", "llm.bank.test",
                                 "https://", "https://x?y=1", "ftp://x"])
def test_a_gateway_that_is_not_https_host_port_is_refused(url: str) -> None:
    with pytest.raises(Invalid, match="https://HOST"):
        connections.discover(url, None)


def test_a_missing_ca_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(Invalid, match="not a file"):
        connections.discover(GATEWAY, tmp_path / "nowhere.pem")


@pytest.mark.parametrize("body", [
    {**FOUND, "published": False},  # a gateway that publishes no logins
    {**FOUND, "realm_path": "/admin/realms/appliance"},  # a path that is not a realm's
    {**FOUND, "realm_path": "/realms/../admin"},
    {k: v for k, v in FOUND.items() if k != "issuer"},
    ["a", "list"],
    "not json at all",
])
def test_a_discovery_that_does_not_say_where_to_log_in_is_refused(monkeypatch: pytest.MonkeyPatch, body: Any,
                                                                   user_config: Path) -> None:
    answering(monkeypatch, body)
    with pytest.raises(Unavailable):
        connections.discover(GATEWAY, None)
    assert not (user_config / "appliance" / "remote.json").exists()


def test_an_unreachable_gateway_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    def get(url: str, **_: Any) -> httpx.Response:
        raise httpx.ConnectError("refused")

    monkeypatch.setattr(connections.httpx, "get", get)
    with pytest.raises(Unavailable, match="does not say where to log in"):
        connections.discover(GATEWAY, None)


def test_a_damaged_profile_is_refused_naming_it(user_config: Path) -> None:
    profile = connections.config_dir() / "remote.json"
    for text in ("{not json", json.dumps(["x"]), json.dumps({"gateway": GATEWAY})):
        profile.write_text(text)
        with pytest.raises(Invalid, match="remote.json is not a remote appliance's profile"):
            connections.current(lambda: pytest.fail("not asked"))
