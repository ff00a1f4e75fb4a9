"""Where the CLI works: this host's appliance, or a remote one chosen with `appliance token
--gateway`: what the gateway's discovery must say, what is kept (0700/0600) and how a damaged or
foreign profile is refused."""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Iterator
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


def answering(monkeypatch: pytest.MonkeyPatch, body: Any, status: int = 200, raw: bytes | None = None) -> list[str]:
    """The gateway's discovery, answered here (no request leaves the process)."""
    asked: list[str] = []

    @contextlib.contextmanager
    def stream(method: str, url: str, **_: Any) -> Iterator[httpx.Response]:
        asked.append(url)
        content = raw if raw is not None else json.dumps(body).encode()
        yield httpx.Response(status, content=content, request=httpx.Request(method, url))

    monkeypatch.setattr(connections.httpx, "stream", stream)
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
    def stream(method: str, url: str, **_: Any) -> httpx.Response:
        raise httpx.ConnectError("refused")

    monkeypatch.setattr(connections.httpx, "stream", stream)
    with pytest.raises(Unavailable, match="does not say where to log in"):
        connections.discover(GATEWAY, None)


def test_a_damaged_profile_is_refused_naming_it(user_config: Path) -> None:
    profile = connections.config_dir() / "remote.json"
    for text in ("{not json", json.dumps(["x"]), json.dumps({"gateway": GATEWAY})):
        profile.write_text(text)
        with pytest.raises(Invalid, match="remote.json is not a remote appliance's profile"):
            connections.current(lambda: pytest.fail("not asked"))


@pytest.mark.parametrize("raw", [b"[" * 100_000, b'{"issuer": "' + b"x" * 200_000 + b'"}'])
def test_a_discovery_too_deep_or_too_large_is_refused(monkeypatch: pytest.MonkeyPatch, raw: bytes) -> None:
    answering(monkeypatch, None, raw=raw)
    with pytest.raises(Unavailable):
        connections.discover(GATEWAY, None)


def test_a_gateway_claiming_anothers_realm_gets_a_login_cache_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    answering(monkeypatch, FOUND)
    genuine = connections.discover(GATEWAY, None)
    answering(monkeypatch, FOUND)  # the same issuer, claimed by another gateway
    rogue = connections.discover("https://rogue.test:8443", None)
    assert rogue.issuer == genuine.issuer and rogue.token_cache != genuine.token_cache


def test_a_configuration_directory_of_another_user_is_not_used(user_config: Path) -> None:
    directory = user_config / "appliance"
    directory.mkdir(mode=0o700)
    os.chown(directory, 65534, 65534)  # planted by nobody (root can make it so; so could a `su` that kept the variable)
    with pytest.raises(Invalid, match="belongs to another user"):
        connections.config_dir()


def test_a_planted_link_beside_the_cache_is_not_followed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    answering(monkeypatch, FOUND)
    remote = connections.discover(GATEWAY, None)
    precious = tmp_path / "precious"
    precious.write_text("keep")
    remote.token_cache.parent.mkdir(parents=True, exist_ok=True)
    for guess in (f".{remote.token_cache.name}.partial",):  # the name writes once used
        (remote.token_cache.parent / guess).symlink_to(precious)
    login.save(remote, admin_token())
    assert precious.read_text() == "keep" and login.cached_login(remote).username == "admin"
