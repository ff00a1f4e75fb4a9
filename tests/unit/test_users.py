"""python-keycloak's errors become the core's, once, at the users boundary (the admin API, CLI and
TUI then answer them through the one error table); enabling, granting, revoking (never the last
administrator's admin role) and resetting passwords, against a fake Keycloak admin."""

from __future__ import annotations

from typing import Any

import pytest
from keycloak.exceptions import KeycloakConnectionError, KeycloakPostError

from appliance.errors import ApplianceError, Conflict, NotFound, Unavailable
from appliance.home import Home
from appliance.roles import ROLE_ORDER, Role
from appliance.settings import Settings
from appliance.users import Users, _keycloak


@pytest.mark.parametrize(("raised", "family", "says"), [
    (KeycloakPostError("exists", response_code=409), Conflict, "adding 'kate': a user with that name exists"),
    (KeycloakPostError("gone", response_code=404), NotFound, "no such user"),
    (KeycloakPostError("boom", response_code=500), Unavailable, "Keycloak refused (500)"),
    (KeycloakConnectionError("refused"), Unavailable, "Keycloak refused (no answer)"),
])
def test_keycloak_errors_are_translated_once(raised: Exception, family: type[ApplianceError], says: str) -> None:
    with pytest.raises(family, match=says.replace("(", r"\(").replace(")", r"\)")):
        with _keycloak("adding 'kate'"):
            raise raised


def test_every_role_has_a_rank() -> None:
    assert sorted(ROLE_ORDER) == sorted(Role)


class FakeAdmin:
    """The few calls of python-keycloak's KeycloakAdmin that appliance.users makes, on a dict."""

    def __init__(self, users: dict[str, tuple[bool, set[str]]]) -> None:
        self.users: dict[str, dict[str, Any]] = {
            name: {"id": f"id-{name}", "username": name, "enabled": enabled, "roles": set(roles)}
            for name, (enabled, roles) in users.items()}
        self.passwords: dict[str, str] = {}

    def _by_id(self, user_id: str) -> dict[str, Any]:
        return next(user for user in self.users.values() if user["id"] == user_id)

    def get_user_id(self, username: str) -> str | None:
        return self.users[username]["id"] if username in self.users else None

    def get_user(self, user_id: str) -> dict[str, Any]:
        return self._by_id(user_id)

    def update_user(self, user_id: str, payload: dict[str, Any]) -> None:
        self._by_id(user_id).update(payload)

    def get_realm_role(self, name: str) -> dict[str, str]:
        return {"name": name}

    def get_realm_roles_of_user(self, user_id: str) -> list[dict[str, str]]:
        return [{"name": role} for role in self._by_id(user_id)["roles"]]

    def get_realm_role_members(self, role: str) -> list[dict[str, Any]]:
        return [user for user in self.users.values() if role in user["roles"]]

    def assign_realm_roles(self, user_id: str, roles: list[dict[str, str]]) -> None:
        self._by_id(user_id)["roles"] |= {role["name"] for role in roles}

    def delete_realm_roles_of_user(self, user_id: str, roles: list[dict[str, str]]) -> None:
        self._by_id(user_id)["roles"] -= {role["name"] for role in roles}

    def set_user_password(self, user_id: str, password: str, temporary: bool = True) -> None:
        assert not temporary
        self.passwords[user_id] = password


@pytest.fixture
def realm(monkeypatch: pytest.MonkeyPatch, home: Home) -> tuple[Users, FakeAdmin]:
    admin = FakeAdmin({"root": (True, {"admin"}), "alice": (False, {"user"}),
                       "service-account-gateway": (True, {"admin"})})
    monkeypatch.setattr(Users, "_admin", lambda self: admin)
    return Users(Settings(), home), admin


def test_enable_grant_and_revoke(realm: tuple[Users, FakeAdmin]) -> None:
    users, _ = realm
    assert users.enable("alice").enabled
    assert users.grant("alice", Role.TRAINER).roles == [Role.TRAINER, Role.USER]
    assert users.revoke("alice", Role.USER).roles == [Role.TRAINER]
    assert users.revoke("alice", Role.USER).roles == [Role.TRAINER], "revoking a role not held changes nothing"
    with pytest.raises(NotFound, match="no user named 'bob'"):
        users.revoke("bob", Role.USER)


def test_the_last_enabled_admin_keeps_admin(realm: tuple[Users, FakeAdmin]) -> None:
    users, admin = realm
    with pytest.raises(Conflict, match="revoking admin from 'root': they are the last enabled administrator"):
        users.revoke("root", Role.ADMIN)  # the gateway's service account is no administrator to log in as
    users.grant("alice", Role.ADMIN)
    with pytest.raises(Conflict, match="last enabled administrator"):
        users.revoke("root", Role.ADMIN)  # alice is disabled
    users.enable("alice")
    assert Role.ADMIN not in users.revoke("root", Role.ADMIN).roles
    with pytest.raises(Conflict):
        users.revoke("alice", Role.ADMIN)
    assert "admin" in admin.users["alice"]["roles"]
    with pytest.raises(Conflict, match="disabling 'alice': they are the last enabled administrator"):
        users.disable("alice")
    assert admin.users["alice"]["enabled"]
    users.grant("root", Role.ADMIN)
    assert not users.disable("alice").enabled, "with another administrator, an administrator may be disabled"


def test_a_reset_password_is_generated_once_or_the_one_given(realm: tuple[Users, FakeAdmin]) -> None:
    users, admin = realm
    generated = users.reset_password("alice", None)
    assert generated.password and len(generated.password) >= 20
    assert admin.passwords["id-alice"] == generated.password
    given = users.reset_password("alice", "correct horse battery")
    assert given.password is None, "a password the caller chose is never echoed back"
    assert admin.passwords["id-alice"] == "correct horse battery"


def test_the_cli_reads_a_new_password_from_stdin_never_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from appliance.commands import users as users_cli

    sent: list[tuple[str, str, Any]] = []

    def admin_api(method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        sent.append((method, path, kwargs.get("json")))
        return {"username": "alice", "password": None if kwargs["json"]["password"] else "generated-secret"}

    monkeypatch.setattr(users_cli, "admin_api", admin_api)
    runner = CliRunner()
    typed = runner.invoke(users_cli.users_app, ["reset-password", "alice", "--password-stdin"],
                          input="correct horse battery\n")
    assert typed.exit_code == 0, typed.output
    assert "correct horse" not in typed.output
    shown = runner.invoke(users_cli.users_app, ["reset-password", "alice"])
    assert "generated password (shown once): generated-secret" in shown.output
    assert sent == [("POST", "/users/alice/password", {"password": "correct horse battery"}),
                    ("POST", "/users/alice/password", {"password": None})]
    refused = runner.invoke(users_cli.users_app, ["reset-password", "alice", "hunter22"])
    assert refused.exit_code == 2, "no password on the command line"


def test_the_admin_api_names_each_user_action(home: Home) -> None:
    from fastapi.routing import APIRoute

    from serve.gateway import create_app

    named = {route.name: (sorted(route.methods), route.path) for route in create_app(Settings(), home).routes
             if isinstance(route, APIRoute) and route.name.startswith("users.")}
    assert named["users.enable"] == (["POST"], "/admin/users/{username}/enable")
    assert named["users.grant"] == (["POST"], "/admin/users/{username}/roles")
    assert named["users.revoke"] == (["DELETE"], "/admin/users/{username}/roles/{role}")
    assert named["users.reset_password"] == (["POST"], "/admin/users/{username}/password")
