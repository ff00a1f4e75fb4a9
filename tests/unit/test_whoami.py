"""Who the CLI is logged in as: `appliance whoami` reads the login cache locally, `appliance token
--user X --print` leaves the cached login alone unless --save, and a 403 from the admin API says
whose login was refused."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from appliance import admin_client, cli, login
from appliance.errors import ApplianceError
from appliance.home import Home
from tests.support.tokens import ISSUER, admin_token, here


@pytest.fixture
def cli_home(home: Home, monkeypatch: pytest.MonkeyPatch) -> Home:
    monkeypatch.setenv("APPLIANCE_HOME", str(home.root))
    return home


def run(*args: str, stdin: str | None = None) -> Any:
    return CliRunner().invoke(cli.app, list(args), input=stdin)


# --- whoami --------------------------------------------------------------------------------


def test_whoami_says_who_with_roles_client_and_both_expiries(cli_home: Home) -> None:
    login.save(here(cli_home), admin_token(access_s=270, refresh_s=1770))
    result = run("whoami")
    assert result.exit_code == 0, result.output
    lines = dict(line.split(":", 1) for line in result.output.splitlines())
    assert lines["user"].strip() == "admin"
    assert lines["roles"].strip() == "admin, offline_access"
    assert lines["client"].strip() == "appliance-cli"
    assert lines["issuer"].strip() == ISSUER
    assert "(in 4m" in lines["access token"] and "(in 29m" in lines["refresh token"]
    assert lines["cache"].strip() == str(here(cli_home).token_cache)
    assert lines["gateway"].strip() == "http://127.0.0.1:8080"


def test_whoami_json(cli_home: Home) -> None:
    login.save(here(cli_home), admin_token(roles=("auditor",)))
    result = run("whoami", "--json")
    assert result.exit_code == 0, result.output
    view = json.loads(result.output)
    assert view["logged_in"] is True
    assert (view["username"], view["roles"], view["client"], view["issuer"]) == (
        "admin", ["auditor"], "appliance-cli", ISSUER)
    assert 290 < view["access_token_expires_in_s"] <= 300 and view["access_token_expires_at"].endswith("Z")
    assert 1790 < view["refresh_token_expires_in_s"] <= 1800


def test_an_expired_access_token_with_a_live_refresh_token_is_still_a_login(cli_home: Home) -> None:
    login.save(here(cli_home), admin_token(access_s=-200))
    result = run("whoami")
    assert result.exit_code == 0, result.output
    assert "(expired 3m" in result.output and "the next command refreshes it" in result.output


def test_an_expired_login_says_so_and_how_to_log_in(cli_home: Home) -> None:
    login.save(here(cli_home), admin_token(access_s=-4000, refresh_s=-3700))
    result = run("whoami")
    assert isinstance(result.exception, ApplianceError)
    assert result.exception.one_line() == "the cached login of admin has expired; log in again: `appliance token`"
    assert "(expired 1h0" in result.output  # the details are still shown
    as_json = run("whoami", "--json")
    assert as_json.exit_code == 1 and json.loads(as_json.output)["logged_in"] is False


def test_no_login_says_so_and_how_to_log_in(cli_home: Home) -> None:
    result = run("whoami")
    assert isinstance(result.exception, login.LoginError)
    assert result.exception.one_line() == "not logged in; run `appliance token` first"
    as_json = run("whoami", "--json")
    assert as_json.exit_code == 1
    assert json.loads(as_json.output) == {"logged_in": False, "reason": "not logged in; run `appliance token` first"}


@pytest.mark.parametrize(("cache", "says"), [
    ("{not json", "is not a cached login (Expecting property name"),
    ('["a", "list"]', "is not a cached login"),
    (json.dumps({"username": "admin"}), "missing 4 required positional arguments"),
    (json.dumps({"username": "admin", "access_token": "a.b.c", "refresh_token": "",
                 "expires_at": "soon", "refresh_expires_at": 0}), "(expires_at is str)"),
])
def test_a_damaged_cache_is_named_with_what_is_wrong(cli_home: Home, cache: str, says: str) -> None:
    here(cli_home).token_cache.parent.mkdir(parents=True, exist_ok=True)
    here(cli_home).token_cache.write_text(cache)
    result = run("whoami")
    assert isinstance(result.exception, login.LoginError)
    assert str(here(cli_home).token_cache) in result.exception.message and says in result.exception.message


@pytest.mark.parametrize(("access", "says"), [
    ("opaque-token", "the access token is not a JWT: 1 dot-separated parts, not 3"),
    ("a.!!!.c", "the access token's claims cannot be decoded"),
    (f"a.{base64.urlsafe_b64encode(b'[1]').decode()}.c", "the access token's claims are a JSON list, not an object"),
])
def test_an_access_token_that_is_not_a_jwt_is_said_plainly(cli_home: Home, access: str, says: str) -> None:
    login.save(here(cli_home), login.CachedToken("admin", access, "", time.time() + 60, 0))
    result = run("whoami")
    assert isinstance(result.exception, login.LoginError) and says in result.exception.message


# --- token --user X --print ----------------------------------------------------------------


@pytest.fixture
def keycloak(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, str]]:
    """Keycloak's token endpoint, answering every password login with a token of that user."""
    asked: list[dict[str, str]] = []

    def post(connection: Any, name: str, data: dict[str, str]) -> httpx.Response:
        asked.append(data)
        return httpx.Response(200, json={"access_token": admin_token(data["username"], ("user",)).access_token,
                                         "refresh_token": "r", "expires_in": 300, "refresh_expires_in": 1800})
    monkeypatch.setattr(login, "_post", post)
    return asked


def cached_user(home: Home) -> str:
    return login.cached_login(here(home)).username


def test_printing_another_users_token_leaves_the_cached_login(cli_home: Home, keycloak: list[Any]) -> None:
    login.save(here(cli_home), admin_token("admin"))
    result = run("token", "--user", "alice", "--password-stdin", "--print", stdin="pw\n")
    assert result.exit_code == 0, result.output
    assert login.token_claims(result.output.strip())["preferred_username"] == "alice"
    assert keycloak[0]["username"] == "alice"
    assert cached_user(cli_home) == "admin"


def test_save_caches_the_printed_token(cli_home: Home, keycloak: list[Any]) -> None:
    login.save(here(cli_home), admin_token("admin"))
    result = run("token", "--user", "alice", "--password-stdin", "--print", "--save", stdin="pw\n")
    assert result.exit_code == 0, result.output
    assert cached_user(cli_home) == "alice"


def test_a_password_login_without_print_is_cached(cli_home: Home, keycloak: list[Any]) -> None:
    result = run("token", "--user", "alice", "--password-stdin", stdin="pw\n")
    assert result.exit_code == 0, result.output
    assert "logged in as alice" in result.output and cached_user(cli_home) == "alice"


@pytest.mark.parametrize("args", [["--save"], ["--print", "--save"], ["--user", "alice", "--password-stdin", "--save"]])
def test_save_without_user_and_print_is_refused(cli_home: Home, keycloak: list[Any], args: list[str]) -> None:
    result = run("token", *args, stdin="pw\n")
    assert isinstance(result.exception, ApplianceError)
    assert result.exception.message == "--save goes with --user and --print: a login without --print is always cached"
    assert not keycloak and not here(cli_home).token_cache.exists()


# --- a 403 says who is logged in -----------------------------------------------------------


def test_a_403_names_the_login_and_its_roles() -> None:
    refused = httpx.Response(403, json={"error": {"message": "forbidden: needs role admin"}})
    with pytest.raises(admin_client.Refused) as error:
        admin_client._answer(refused, "GET", "/users", admin_token("alice", ("user",)))
    assert error.value.status == 403
    assert error.value.one_line() == ("GET /admin/users: 403 forbidden: needs role admin; logged in as alice "
                                      "(roles: user): log in as a user with the role it needs (`appliance token`)")


def test_other_refusals_carry_no_login_hint() -> None:
    with pytest.raises(admin_client.Refused) as error:
        admin_client._answer(httpx.Response(404, json={"error": {"message": "no such user"}}), "GET", "/users/x",
                             admin_token())
    assert error.value.hint is None


def test_a_403_with_an_unreadable_token_still_names_the_user() -> None:
    token = login.CachedToken("bob", "opaque", "", time.time() + 60, 0)
    with pytest.raises(admin_client.Refused) as error:
        admin_client._answer(httpx.Response(403, text="no"), "POST", "/users", token)
    assert "logged in as bob (roles unreadable)" in error.value.one_line()
