"""Realm users (their roles are appliance.roles): the user records the admin API, CLI and TUI
show, and the calls that read and change users in Keycloak. python-keycloak's errors are
translated here, once: a name taken is a Conflict, no such user NotFound, what Keycloak refuses
as bad (a password its policy refuses, naming the rule) Invalid, anything else from Keycloak (down,
refusing) Unavailable."""

from __future__ import annotations

import json
import secrets as token_source
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from keycloak import KeycloakAdmin, KeycloakOpenIDConnection
from keycloak.exceptions import KeycloakError
from pydantic import BaseModel, Field

from appliance import batches
from appliance.errors import Conflict, Invalid, NotFound, Unavailable
from appliance.home import Home
from appliance.roles import Role
from appliance.secrets import gateway_client_secret
from appliance.settings import Settings
from appliance.tls import keycloak_trust


class User(BaseModel):
    username: str
    enabled: bool
    roles: list[Role]


class NewUser(BaseModel):
    username: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]{1,63}$")
    roles: list[Role] = Field(min_length=1)
    password: str | None = Field(None, min_length=8, description="Unset: one is generated. Keycloak checks it "
                                 "against the realm's password policy (keycloak.password_policy).")


class CreatedUser(User):
    password: str | None = Field(None, description="The generated password, shown only here.")


class NewPassword(BaseModel):
    password: str | None = Field(None, min_length=8, description="Unset: one is generated. Keycloak checks it "
                                 "against the realm's password policy (keycloak.password_policy).")


class PasswordReset(BaseModel):
    username: str
    password: str | None = Field(None, description="The generated password, shown only here.")


@contextmanager
def _keycloak(doing: str) -> Iterator[None]:
    try:
        yield
    except KeycloakError as exc:
        status = getattr(exc, "response_code", None)
        if status == 409:
            raise Conflict(f"{doing}: a user with that name exists") from exc
        if status == 404:
            raise NotFound(f"{doing}: Keycloak has no such user") from exc
        if status == 400:
            raise _refused(doing, exc) from exc
        raise Unavailable(f"{doing}: Keycloak refused ({status or 'no answer'}): {exc}") from exc


def _refused(doing: str, exc: KeycloakError) -> Invalid:
    """What Keycloak said was wrong with the request; for a password, the rule of the realm's
    policy it broke (Keycloak names it, e.g. invalidPasswordMinLengthMessage: "minimum length 12")."""
    try:
        body = json.loads(exc.response_body or b"{}")
    except ValueError:
        body = {}
    error = str(body.get("error") or body.get("errorMessage") or "")
    said = str(body.get("error_description") or error or "no reason given")
    if error.startswith("invalidPassword"):
        rule = said.removeprefix("Invalid password: ").rstrip(".")
        return Invalid(f"{doing}: the password breaks the realm's password policy: {rule} ({error})",
                       hint="choose another password (settings: keycloak.password_policy)")
    return Invalid(f"{doing}: Keycloak refused it: {said}")


class Users:
    """The realm's users, managed with the gateway's service account."""

    def __init__(self, settings: Settings, home: Home) -> None:
        self.settings = settings
        self.home = home
        self._connected: KeycloakAdmin | None = None

    def _admin(self) -> KeycloakAdmin:
        """The service account's client, logged in once per Users (python-keycloak renews its
        token when it runs out): a long-lived Users, such as the gateway's, logs in once."""
        if self._connected is None:
            keycloak = self.settings.keycloak
            connection = KeycloakOpenIDConnection(
                server_url=keycloak.base_url, realm_name=keycloak.realm, client_id=keycloak.gateway_client_id,
                client_secret_key=gateway_client_secret(self.settings, self.home), timeout=15,
                verify=keycloak_trust(self.settings, self.home))
            self._connected = KeycloakAdmin(connection=connection)
        return self._connected

    def listing(self) -> list[User]:
        """Users of the realm with their appliance roles (service accounts left out)."""
        with _keycloak("listing users"):
            admin = self._admin()
            return [_user(admin, raw) for raw in admin.get_users({"briefRepresentation": True})
                    if not raw["username"].startswith("service-account-")]

    def lookup(self, username: str) -> tuple[str, User]:
        """The user's id (their tokens' subject) and record as Keycloak holds them now. After a
        failure the next lookup logs in again (Keycloak may have restarted)."""
        try:
            with _keycloak(f"looking up {username!r}"):
                admin = self._admin()
                user_id = self._id(admin, username)
                return user_id, _user(admin, admin.get_user(user_id))
        except Unavailable:
            self._connected = None
            raise

    def add(self, new: NewUser) -> CreatedUser:
        """An enabled user with roles; without a password, one is generated and returned once."""
        password = new.password or token_source.token_urlsafe(18)
        with _keycloak(f"adding {new.username!r}"):
            admin = self._admin()
            user_id = admin.create_user({
                "username": new.username, "enabled": True, "emailVerified": True,
                "firstName": new.username, "lastName": "-", "email": f"{new.username}@appliance.local",
                "credentials": [{"type": "password", "value": password, "temporary": False}]})
            admin.assign_realm_roles(user_id, [admin.get_realm_role(role) for role in new.roles])
        return CreatedUser(username=new.username, enabled=True, roles=sorted(new.roles),
                           password=None if new.password else password)

    def disable(self, username: str) -> User:
        """New logins fail; live tokens stop within the gateway's introspection interval; their
        batches in progress are cancelled (they run as their owner). The last enabled
        administrator is never disabled: no one could enable them again."""
        with _keycloak(f"disabling {username!r}"):
            admin = self._admin()
            user_id = self._id(admin, username)
            if Role.ADMIN in _user(admin, admin.get_user(user_id)).roles and not _other_admins(admin, username):
                raise Conflict(f"disabling {username!r}: they are the last enabled administrator",
                               hint="grant admin to another user first")
            admin.update_user(user_id, {"enabled": False})
            user = _user(admin, admin.get_user(user_id))
        batches.cancel_all_of(self.home, user_id)  # the token subject is the user's id
        return user

    def enable(self, username: str) -> User:
        """Let a disabled user log in again (their batches cancelled on disabling stay cancelled)."""
        with _keycloak(f"enabling {username!r}"):
            admin = self._admin()
            user_id = self._id(admin, username)
            admin.update_user(user_id, {"enabled": True})
            return _user(admin, admin.get_user(user_id))

    def unlock(self, username: str) -> User:
        """Clear the user's failed logins and any lockout brute-force detection put on them (it
        locks per account, so anyone who can reach Keycloak can keep an account locked by guessing:
        this is the way back in, for the administrator or, on the host, for the administrator
        locked out themselves)."""
        with _keycloak(f"unlocking {username!r}"):
            admin = self._admin()
            user_id = self._id(admin, username)
            admin.clear_bruteforce_attempts_for_user(user_id)
            return _user(admin, admin.get_user(user_id))

    def grant(self, username: str, role: Role) -> User:
        """One more realm role (granting one the user holds changes nothing)."""
        with _keycloak(f"granting {role} to {username!r}"):
            admin = self._admin()
            user_id = self._id(admin, username)
            admin.assign_realm_roles(user_id, [admin.get_realm_role(role)])
            return _user(admin, admin.get_user(user_id))

    def revoke(self, username: str, role: Role) -> User:
        """One realm role fewer (revoking one the user lacks changes nothing). The admin role is
        never revoked from the last enabled administrator: no one could grant it back."""
        with _keycloak(f"revoking {role} from {username!r}"):
            admin = self._admin()
            user_id = self._id(admin, username)
            if role == Role.ADMIN and not _other_admins(admin, username):
                raise Conflict(f"revoking admin from {username!r}: they are the last enabled administrator",
                               hint="grant admin to another user first")
            admin.delete_realm_roles_of_user(user_id, [admin.get_realm_role(role)])
            return _user(admin, admin.get_user(user_id))

    def reset_password(self, username: str, password: str | None) -> PasswordReset:
        """A new password (not temporary); without one, one is generated and returned once."""
        chosen = password or token_source.token_urlsafe(18)
        with _keycloak(f"resetting the password of {username!r}"):
            admin = self._admin()
            admin.set_user_password(self._id(admin, username), chosen, temporary=False)
        return PasswordReset(username=username, password=None if password else chosen)

    @staticmethod
    def _id(admin: KeycloakAdmin, username: str) -> str:
        user_id = admin.get_user_id(username)
        if user_id is None:
            raise NotFound(f"no user named {username!r}")
        return str(user_id)


def _other_admins(admin: KeycloakAdmin, username: str) -> list[str]:
    """Enabled users other than `username` who hold the admin role (service accounts left out)."""
    return [member["username"] for member in admin.get_realm_role_members(Role.ADMIN)
            if member["username"] != username and member.get("enabled", False)
            and not member["username"].startswith("service-account-")]


def _user(admin: KeycloakAdmin, raw: dict[str, Any]) -> User:
    known = {role.value for role in Role}
    roles = sorted(Role(r["name"]) for r in admin.get_realm_roles_of_user(raw["id"]) if r["name"] in known)
    return User(username=raw["username"], enabled=raw.get("enabled", False), roles=roles)
