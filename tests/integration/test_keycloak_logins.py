"""Logins that cannot be guessed, against the running appliance's real Keycloak: wrong passwords lock
an account for a while (the right one is refused until the wait passes), the password grant is
refused to clients that must not have it, the realm's policy refuses a weak password naming the
rule, and failed logins, lockouts and admin changes reach the audit log with user and source, the
chain still verifying.

The session's thresholds are small (tests/integration/conftest.py): 3 wrong passwords lock for 3 s,
the quick-login check is off (so the count alone locks), events are copied every second."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from appliance.secrets import gateway_client_secret, rl_client_secret, secret
from audit.writer import log_files
from installer.realm import BOOTSTRAP_SECRET
from tests.integration.conftest import Running
from tests.integration.realm import Realm

PASSWORD = "Test-password-1"
WRONG = "Not-the-password-1"


@pytest.fixture(scope="module")
def realm(running: Running) -> Realm:
    return Realm(running)


def password_grant(realm: Realm, username: str, password: str, client_id: str = "appliance-cli",
                   client_secret: str | None = None) -> httpx.Response:
    auth = (client_id, client_secret) if client_secret else None
    data = {"grant_type": "password", "username": username, "password": password}
    if auth is None:
        data["client_id"] = client_id
    return httpx.post(f"{realm.issuer}/protocol/openid-connect/token", data=data, auth=auth, timeout=30,
                      verify=realm.tls)


def brute_force(realm: Realm, user_id: str) -> dict[str, Any]:
    path = f"admin/realms/{realm.settings.keycloak.realm}/attack-detection/brute-force/users/{user_id}"
    status: dict[str, Any] = realm.admin.connection.raw_get(path).json()
    return status


def until(check: Callable[[], Any], what: str, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def records(running: Running) -> list[dict[str, Any]]:
    return [json.loads(line) for path in log_files(running.appliance.home.audit)
            for line in path.read_bytes().splitlines()]


def test_wrong_passwords_lock_the_account_until_the_wait_passes(realm: Realm) -> None:
    user_id = realm.ensure_user("lockee", PASSWORD, ["user"])
    # Keycloak 26 records a failure asynchronously, and a login for the same user that arrives while the
    # last one is still being recorded is refused without being counted (keycloak#52428): each wrong
    # password is sent once the one before it has been counted, as a person would type them.
    def counted(count: int) -> None:
        until(lambda: brute_force(realm, user_id)["numFailures"] >= count, f"wrong password {count} counted", 30)

    for count in (1, 2):
        assert password_grant(realm, "lockee", WRONG).status_code == 400
        counted(count)
    assert not brute_force(realm, user_id)["disabled"], "two wrong passwords do not lock (failure factor 3)"
    assert password_grant(realm, "lockee", WRONG).status_code == 400
    locked_at = time.monotonic()
    until(lambda: brute_force(realm, user_id)["disabled"], "the third wrong password to lock", 30)
    refused = password_grant(realm, "lockee", PASSWORD)
    assert refused.status_code == 400 and refused.json()["error"] == "invalid_grant", "the right password, locked"

    until(lambda: not brute_force(realm, user_id)["disabled"], "the lockout to pass")
    assert time.monotonic() - locked_at >= 8.0, "the lockout lasts about lockout_wait_s (10 s)"
    assert password_grant(realm, "lockee", PASSWORD).status_code == 200


def test_the_password_grant_is_refused_to_clients_that_must_not_have_it(running: Running, realm: Realm) -> None:
    realm.ensure_user("granted", PASSWORD, ["user"])
    home = running.appliance.home
    keycloak = realm.settings.keycloak
    for client_id, client_secret in [("admin-cli", None),  # Keycloak's own public client of the realm
                                     (keycloak.gateway_client_id, gateway_client_secret(realm.settings, home)),
                                     (realm.settings.rl.client_id, rl_client_secret(home))]:
        refused = password_grant(realm, "granted", PASSWORD, client_id, client_secret)
        assert refused.status_code in (400, 401), (client_id, refused.text)
        assert refused.json()["error"] == "unauthorized_client", (client_id, refused.text)
    assert password_grant(realm, "granted", PASSWORD).status_code == 200, "the CLI's client keeps it, for scripts"
    clients = {c["clientId"]: c for c in realm.admin.get_clients()}
    assert clients[keycloak.cli_client_id]["attributes"]["oauth2.device.authorization.grant.enabled"] == "true"


def test_a_weak_password_is_refused_naming_the_rule(running: Running, realm: Realm) -> None:
    cli = running.appliance
    login = cli.run("token", "--user", "admin", "--password-stdin",
                    stdin=secret(cli.home, BOOTSTRAP_SECRET) + "\n", timeout=60)
    assert login.returncode == 0, login.stderr
    short = cli.run("users", "add", "weakling", "--role", "user", "--password-stdin", stdin="Short-pw1\n", timeout=60)
    assert short.returncode == 1
    assert "the password breaks the realm's password policy: minimum length 12" in short.stderr, short.stderr
    assert "Short-pw1" not in short.stdout + short.stderr
    named = cli.run("users", "add", "weakling", "--role", "user", "--password-stdin", stdin="weakling\n", timeout=60)
    assert named.returncode == 1 and "password policy" in named.stderr, named.stderr
    assert realm.admin.get_user_id("weakling") is None, "no user is left behind without a password"
    strong = cli.run("users", "add", "weakling", "--role", "user", "--password-stdin", stdin="Strong-enough-1\n",
                     timeout=60)
    assert strong.returncode == 0, strong.stderr
    assert realm.token("weakling", "Strong-enough-1")


def test_failed_logins_lockouts_and_admin_changes_reach_the_audit_log(running: Running, realm: Realm) -> None:
    user_id = realm.ensure_user("guessed", PASSWORD, ["user"])
    for _ in range(5):  # three lock the account; the other two are refused as locked
        assert password_grant(realm, "guessed", WRONG).status_code == 400

    def mine(action: str) -> Callable[[], list[dict[str, Any]]]:
        return lambda: [r for r in records(running) if r["action"] == action and r["subject"] == user_id]

    [failed, *_] = until(mine("keycloak.login_error"), "a failed login's record")
    assert (failed["username"], failed["source"], failed["outcome"]) == ("guessed", "127.0.0.1", "denied")
    assert failed["client"] == "appliance-cli" and failed["error"] == "invalid_user_credentials"
    [locked, *_] = until(mine("keycloak.lockout"), "the lockout's record")
    assert (locked["username"], locked["source"], locked["status"]) == ("guessed", "127.0.0.1", 423)
    def counted() -> int:  # by its own record, or in a summary (audit.refusal_interval_s)
        return sum(r["count"] or 1 for r in mine("keycloak.login_error")())

    until(lambda: counted() >= 5, "every failed login counted", timeout_s=45)
    assert counted() == 5 and any(r["count"] for r in mine("keycloak.login_error")()), "summarised, none twice"
    created = until(lambda: [r for r in records(running) if r["action"] == "keycloak.admin.create"
                             and (r.get("target") or {}).get("name") == f"users/{user_id}"],
                    "the admin event of the user's creation")
    assert created[0]["source"] == "127.0.0.1" and created[0]["subject"]

    copied = [r["request_id"] for r in records(running) if r["request_id"].startswith("keycloak:")]
    assert len(copied) == len(set(copied)), "no event copied twice"
    verified = running.appliance.run("audit", "verify", timeout=120)
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_a_locked_account_is_unlocked_by_the_administrator_on_the_host(realm: Realm, running: Running) -> None:
    """Lockout is per account, so anyone can keep one locked by guessing: `users unlock` clears
    it (on the host, without the admin API: the way back in for a locked-out administrator)."""
    user_id = realm.ensure_user("unlockee", PASSWORD, ["user"])
    for _ in range(3):
        password_grant(realm, "unlockee", WRONG)
    until(lambda: brute_force(realm, user_id)["disabled"], "three wrong passwords to lock", 8)
    result = running.appliance.run("users", "unlock", "unlockee", "--on-host", timeout=120)
    assert result.returncode == 0 and "user unlockee unlocked" in result.stdout, result.stdout + result.stderr
    status = brute_force(realm, user_id)
    assert not status["disabled"] and status["numFailures"] == 0, "cleared, not waited out"
    assert any(r["action"] == "users.unlock" and r["outcome"] == "allowed" for r in records(running))
    missing = running.appliance.run("users", "unlock", "nobody-here", "--on-host", timeout=120)
    assert missing.returncode != 0 and "no user named 'nobody-here'" in missing.stderr
