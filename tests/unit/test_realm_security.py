"""The realm's brute-force detection, password policy, event store and password-grant clients follow
the settings, and provisioning brings an existing realm back to them (a second run changes nothing);
a password the realm's policy refuses is an Invalid naming the rule; a refused password login says
what may be wrong (a lockout looks like a wrong password)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from keycloak.exceptions import KeycloakPostError

from appliance import login
from appliance.errors import Invalid
from appliance.home import Home
from appliance.settings import KeycloakSettings, Settings
from appliance.users import _keycloak
from installer.realm import (
    KEYCLOAK_ADMIN_CLI,
    ProvisionReport,
    _cli_client,
    _no_password_grant,
    _realm_security,
    realm_security,
)
from serve.keycloak_events import EVENT_ACTIONS
from tests.support.tokens import here


class FakeAdmin:
    """The few admin calls these steps make, over dicts (a realm that has defaults of a fresh one)."""

    def __init__(self) -> None:
        self.realm: dict[str, Any] = {"bruteForceProtected": False, "failureFactor": 30, "eventsEnabled": False,
                                      "enabledEventTypes": []}
        self.clients: dict[str, dict[str, Any]] = {
            "uuid-admin-cli": {"clientId": KEYCLOAK_ADMIN_CLI, "publicClient": True, "directAccessGrantsEnabled": True,
                               "attributes": {"other": "kept"}}}

    def get_realm(self, name: str) -> dict[str, Any]:
        return dict(self.realm)

    def update_realm(self, name: str, payload: dict[str, Any]) -> None:
        self.realm.update(payload)

    def get_client_id(self, client_id: str) -> str | None:
        return next((uuid for uuid, c in self.clients.items() if c["clientId"] == client_id), None)

    def get_client(self, uuid: str) -> dict[str, Any]:
        return dict(self.clients[uuid])

    def create_client(self, payload: dict[str, Any], skip_exists: bool = False) -> None:
        self.clients[f"uuid-{payload['clientId']}"] = dict(payload)

    def update_client(self, uuid: str, payload: dict[str, Any]) -> None:
        attributes = {**self.clients[uuid].get("attributes", {}), **payload.get("attributes", {})}
        self.clients[uuid].update({**payload, "attributes": attributes})


def test_the_realm_locks_temporarily_with_the_settings_thresholds_and_keeps_events() -> None:
    wanted = realm_security(KeycloakSettings(lockout_failures=3, lockout_wait_s=2, lockout_max_wait_s=5,
                                             quick_login_check_ms=0, quick_login_wait_s=2))
    assert wanted["bruteForceProtected"] is True and wanted["permanentLockout"] is False
    assert (wanted["failureFactor"], wanted["waitIncrementSeconds"], wanted["maxFailureWaitSeconds"]) == (3, 2, 5)
    assert (wanted["quickLoginCheckMilliSeconds"], wanted["minimumQuickLoginWaitSeconds"]) == (0, 2)
    assert wanted["passwordPolicy"] == "length(12) and maxLength(128) and notUsername and notEmail"
    assert set(wanted["enabledEventTypes"]) == set(EVENT_ACTIONS)  # type: ignore[arg-type]
    assert "LOGIN" not in wanted["enabledEventTypes"]  # type: ignore[operator]
    assert wanted["adminEventsEnabled"] is True and wanted["adminEventsDetailsEnabled"] is False


def test_an_existing_realm_is_brought_to_the_settings_once() -> None:
    admin, settings = FakeAdmin(), Settings()
    report = ProvisionReport()
    _realm_security(admin, settings, report)  # type: ignore[arg-type]
    assert admin.realm["bruteForceProtected"] is True and admin.realm["failureFactor"] == 5
    assert report.updated and "bruteForceProtected" in report.updated[0]
    admin.realm["enabledEventTypes"] = list(reversed(admin.realm["enabledEventTypes"]))  # order does not matter
    again = ProvisionReport()
    _realm_security(admin, settings, again)  # type: ignore[arg-type]
    assert again.updated == []


def test_only_the_cli_client_keeps_the_password_grant_and_only_while_the_settings_say_so() -> None:
    admin = FakeAdmin()
    report = ProvisionReport()
    _cli_client(admin, Settings(), report)  # type: ignore[arg-type]
    _no_password_grant(admin, KEYCLOAK_ADMIN_CLI, report)  # type: ignore[arg-type]
    cli = admin.clients["uuid-appliance-cli"]
    assert cli["directAccessGrantsEnabled"] is True and cli["attributes"] == {
        "oauth2.device.authorization.grant.enabled": "true"}
    assert admin.clients["uuid-admin-cli"]["directAccessGrantsEnabled"] is False
    assert admin.clients["uuid-admin-cli"]["attributes"] == {"other": "kept"}
    assert report.created == ["client appliance-cli"]
    assert report.updated == ["client admin-cli: directAccessGrantsEnabled"]

    device_only = Settings(keycloak=KeycloakSettings(cli_password_grant=False))
    again = ProvisionReport()
    _cli_client(admin, device_only, again)  # type: ignore[arg-type]
    _no_password_grant(admin, KEYCLOAK_ADMIN_CLI, again)  # type: ignore[arg-type]
    assert cli is admin.clients["uuid-appliance-cli"] and cli["directAccessGrantsEnabled"] is False
    assert again.updated == ["client appliance-cli: directAccessGrantsEnabled"]


@pytest.mark.parametrize(("body", "says"), [
    (b'{"error":"invalidPasswordMinLengthMessage","error_description":"Invalid password: minimum length 12."}',
     "adding 'kate': the password breaks the realm's password policy: minimum length 12 "
     "(invalidPasswordMinLengthMessage)"),
    (b'{"error":"invalidPasswordNotUsernameMessage","error_description":"Invalid password: must not be equal to '
     b'the username."}', "must not be equal to the username (invalidPasswordNotUsernameMessage)"),
    (b'{"errorMessage":"error-invalid-email"}', "adding 'kate': Keycloak refused it: error-invalid-email"),
    (b"not json", "Keycloak refused it: no reason given"),
])
def test_a_refused_password_names_the_rule_it_broke(body: bytes, says: str) -> None:
    with pytest.raises(Invalid) as refused, _keycloak("adding 'kate'"):
        raise KeycloakPostError(body.decode(), response_code=400, response_body=body)
    assert says in refused.value.message


@pytest.mark.parametrize(("answer", "hint"), [
    ({"error": "invalid_grant", "error_description": "Invalid user credentials"}, "locked for a while"),
    ({"error": "unauthorized_client", "error_description": "Client not allowed for direct access grants"},
     "keycloak.cli_password_grant"),
])
def test_a_refused_password_login_says_what_may_be_wrong(monkeypatch: pytest.MonkeyPatch, home: Home,
                                                         answer: dict[str, str], hint: str) -> None:
    monkeypatch.setattr(login, "_post", lambda *args: httpx.Response(400, json=answer))
    with pytest.raises(login.LoginError) as refused:
        login.password_login(here(home), "kate", "guess")
    assert refused.value.message.startswith("Keycloak refused the login") and hint in (refused.value.hint or "")
