"""Provision realm `appliance` in the embedded Keycloak, idempotently, via its admin API.

Realm roles admin/user/trainer/auditor; a confidential gateway client whose service account may
manage users (the admin API goes through it) and read the realm's events (which the gateway copies
into the audit log, serve.keycloak_events); a public CLI client with the device grant whose tokens
carry the gateway in `aud`; a bootstrap admin user whose generated password is stored 0600 and
reported once, when it is created.

Logins that cannot be guessed: brute-force detection on (a temporary lockout, thresholds from the
settings), a password policy, failed logins, lockouts and admin changes kept in Keycloak's event
store, and the password grant on no client but the CLI's (and there only while
`keycloak.cli_password_grant`). Each run brings these back to the settings' values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from keycloak import KeycloakAdmin, KeycloakOpenIDConnection
from keycloak.exceptions import KeycloakError as KcError

from appliance.errors import ApplianceError
from appliance.home import Home
from appliance.roles import Role
from appliance.secrets import gateway_client_secret, rl_client_secret, secret
from appliance.settings import KeycloakSettings, Settings
from appliance.tls import keycloak_trust
from installer.keycloak import ADMIN_SECRET, ADMIN_USER
from serve.keycloak_events import EVENT_ACTIONS

ROLES = tuple(Role)
BOOTSTRAP_USER = "admin"
BOOTSTRAP_SECRET = "bootstrap-admin-password"
# What the gateway's service account may do in realm-management: list and manage users, read events.
SERVICE_ROLES = ("view-users", "manage-users", "query-users", "view-realm", "view-events")
ACCESS_TOKEN_LIFESPAN_S = 300
# Long enough for the gateway to catch up after a long outage; the store does not grow for ever.
EVENTS_EXPIRATION_S = 30 * 86400
# Keycloak's own public client in every realm; it takes the password grant unless told not to.
KEYCLOAK_ADMIN_CLI = "admin-cli"


class ProvisionError(ApplianceError):
    """Keycloak refused a provisioning step."""


@dataclass
class ProvisionReport:
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)


def master_admin(settings: Settings, home: Home) -> KeycloakAdmin:
    """An admin client for the realm, authenticated as the embedded Keycloak's master admin."""
    connection = KeycloakOpenIDConnection(
        server_url=settings.keycloak.base_url, username=ADMIN_USER,
        password=secret(home, ADMIN_SECRET), realm_name=settings.keycloak.realm,
        user_realm_name="master", client_id="admin-cli", timeout=30,
        verify=keycloak_trust(settings, home),
    )
    return KeycloakAdmin(connection=connection)


def provision(settings: Settings, home: Home) -> ProvisionReport:
    """Bring the realm to the state above; a second run changes nothing."""
    keycloak = settings.keycloak
    report = ProvisionReport()
    if keycloak.mode != "embedded":
        return report
    try:
        admin = master_admin(settings, home)
        realm = keycloak.realm
        # Realm creation needs the master realm in the URL; everything after is in our realm.
        admin.connection.realm_name = "master"
        if realm not in {r["realm"] for r in admin.get_realms()}:
            admin.create_realm({"realm": realm, "enabled": True, "accessTokenLifespan": ACCESS_TOKEN_LIFESPAN_S,
                                **realm_security(keycloak)}, skip_exists=True)
            report.created.append(f"realm {realm}")
        admin.connection.realm_name = realm
        _realm_security(admin, settings, report)
        for role in ROLES:
            if admin.create_realm_role({"name": role}, skip_exists=True):
                report.created.append(f"role {role}")
        _gateway_client(admin, settings, home, report)
        _cli_client(admin, settings, report)
        _rl_client(admin, settings, home, report)
        _no_password_grant(admin, KEYCLOAK_ADMIN_CLI, report)
        _bootstrap_admin(admin, home, report)
    except KcError as exc:
        raise ProvisionError(f"Keycloak refused provisioning realm {keycloak.realm}: {exc}",
                             log=home.logs / "keycloak.log") from exc
    return report


def realm_security(keycloak: KeycloakSettings) -> dict[str, object]:
    """The realm's brute-force detection, password policy and event store, as Keycloak names them."""
    return {
        "bruteForceProtected": True, "permanentLockout": False,
        "failureFactor": keycloak.lockout_failures, "waitIncrementSeconds": keycloak.lockout_wait_s,
        "maxFailureWaitSeconds": keycloak.lockout_max_wait_s, "maxDeltaTimeSeconds": keycloak.lockout_reset_s,
        "quickLoginCheckMilliSeconds": keycloak.quick_login_check_ms,
        "minimumQuickLoginWaitSeconds": keycloak.quick_login_wait_s,
        "passwordPolicy": keycloak.password_policy,
        # The store keeps what the gateway copies into the audit log: failures and lockouts, not
        # successful logins (the gateway records every request a token makes).
        "eventsEnabled": True, "eventsExpiration": EVENTS_EXPIRATION_S, "enabledEventTypes": sorted(EVENT_ACTIONS),
        # Details would copy what an admin sent (a user's representation) into Keycloak's store.
        "adminEventsEnabled": True, "adminEventsDetailsEnabled": False,
        # Published through the gateway: browsers, other machines and every token's `iss` use its
        # public URL, while this host's processes go on asking on loopback; "": loopback only.
        "attributes": {"frontendUrl": keycloak.frontend_url or ""},
    }


def _realm_security(admin: KeycloakAdmin, settings: Settings, report: ProvisionReport) -> None:
    realm = settings.keycloak.realm
    current = admin.get_realm(realm)
    wanted = realm_security(settings.keycloak)
    differing = sorted(key for key, value in wanted.items() if _differs(current.get(key), value))
    if differing:
        admin.update_realm(realm, wanted)
        report.updated.append(f"realm {realm}: {', '.join(differing)}")


def _differs(current: object, wanted: object) -> bool:
    """Whether a realm or client value differs from the one wanted: lists compare as sets, and of a
    map (client attributes) only the keys wanted count."""
    if isinstance(wanted, dict):
        return not isinstance(current, dict) or any(_differs(current.get(k), v) for k, v in wanted.items())
    if wanted == "" and current is None:  # an attribute unset is an attribute empty
        return False
    if isinstance(wanted, list):
        return not isinstance(current, list) or sorted(map(str, current)) != sorted(map(str, wanted))
    return current != wanted


def _client(admin: KeycloakAdmin, wanted: dict[str, object], report: ProvisionReport,
            **on_create: object) -> str:
    """Create the client if missing (with `on_create` too), else bring its top-level settings in
    `wanted` back to these values; its Keycloak id."""
    client_id = str(wanted["clientId"])
    uuid = admin.get_client_id(client_id)
    if uuid is None:
        admin.create_client({**wanted, **on_create}, skip_exists=True)
        report.created.append(f"client {client_id}")
        return _client_uuid(admin, client_id)
    current = admin.get_client(uuid)
    differing = sorted(key for key, value in wanted.items() if _differs(current.get(key), value))
    if differing:
        admin.update_client(uuid, wanted)
        report.updated.append(f"client {client_id}: {', '.join(differing)}")
    return str(uuid)


def _no_password_grant(admin: KeycloakAdmin, client_id: str, report: ProvisionReport) -> None:
    """Take the password grant from a client the appliance does not make (Keycloak's own public
    `admin-cli` of the realm: nothing of the appliance logs in with it), leaving the rest as it is."""
    uuid = admin.get_client_id(client_id)
    if uuid is not None and admin.get_client(uuid).get("directAccessGrantsEnabled"):
        admin.update_client(uuid, {"clientId": client_id, "directAccessGrantsEnabled": False})
        report.updated.append(f"client {client_id}: directAccessGrantsEnabled")


def _service_account(admin: KeycloakAdmin, client_id: str, client_secret: str, report: ProvisionReport,
                     **on_create: object) -> str:
    """A confidential client with a service account and no other grant; its service account's user id."""
    uuid = _client(admin, {
        "clientId": client_id, "protocol": "openid-connect", "publicClient": False,
        "serviceAccountsEnabled": True, "standardFlowEnabled": False, "implicitFlowEnabled": False,
        "directAccessGrantsEnabled": False,
    }, report, secret=client_secret, **on_create)
    return str(admin.get_client_service_account_user(uuid)["id"])


def _gateway_client(admin: KeycloakAdmin, settings: Settings, home: Home, report: ProvisionReport) -> None:
    account = _service_account(admin, settings.keycloak.gateway_client_id, gateway_client_secret(settings, home),
                               report)
    management = _client_uuid(admin, "realm-management")
    granted = {r["name"] for r in admin.get_client_roles_of_user(account, management)}
    wanted = [admin.get_client_role(management, name) for name in SERVICE_ROLES if name not in granted]
    if wanted:
        admin.assign_client_role(account, management, wanted)


def _client_uuid(admin: KeycloakAdmin, client_id: str) -> str:
    """Keycloak's id of a client of the realm; ProvisionError if the realm has none by that name."""
    uuid = admin.get_client_id(client_id)
    if uuid is None:
        raise ProvisionError(f"Keycloak has no client {client_id!r} in realm {admin.connection.realm_name}")
    return uuid


def _cli_client(admin: KeycloakAdmin, settings: Settings, report: ProvisionReport) -> None:
    """The CLI and TUI log in with the device grant; scripts with a password, unless turned off."""
    keycloak = settings.keycloak
    _client(admin, {
        "clientId": keycloak.cli_client_id, "protocol": "openid-connect", "publicClient": True,
        "standardFlowEnabled": False, "implicitFlowEnabled": False, "serviceAccountsEnabled": False,
        "directAccessGrantsEnabled": keycloak.cli_password_grant,
        "attributes": {"oauth2.device.authorization.grant.enabled": "true"},
    }, report, protocolMappers=[_gateway_audience(settings)])


def _rl_client(admin: KeycloakAdmin, settings: Settings, home: Home, report: ProvisionReport) -> None:
    """The RL loop's service identity: a confidential client whose service account has roles `user`
    and `rl-policy` (a GRPO run's policy in training is served to that role only, which no person
    holds unless an administrator grants it) and whose tokens carry the gateway in `aud`, so its
    generations are authenticated, rate-limited and audited as any user's."""
    account = _service_account(admin, settings.rl.client_id, rl_client_secret(home), report,
                               protocolMappers=[_gateway_audience(settings)])
    held = {r["name"] for r in admin.get_realm_roles_of_user(account)}
    if missing := [role for role in (Role.USER, Role.RL_POLICY) if role not in held]:
        admin.assign_realm_roles(account, [admin.get_realm_role(role) for role in missing])


def _gateway_audience(settings: Settings) -> dict[str, object]:
    return {"name": "gateway-audience", "protocol": "openid-connect", "protocolMapper": "oidc-audience-mapper",
            "config": {"included.client.audience": settings.keycloak.gateway_client_id,
                       "access.token.claim": "true", "id.token.claim": "false"}}


def _bootstrap_admin(admin: KeycloakAdmin, home: Home, report: ProvisionReport) -> None:
    if admin.get_user_id(BOOTSTRAP_USER) is not None:
        return
    password = secret(home, BOOTSTRAP_SECRET)
    user_id = admin.create_user({
        "username": BOOTSTRAP_USER, "enabled": True, "emailVerified": True,
        "firstName": "Appliance", "lastName": "Admin", "email": "admin@appliance.local",
        "credentials": [{"type": "password", "value": password, "temporary": False}],
    }, exist_ok=True)
    admin.assign_realm_roles(user_id, [admin.get_realm_role(r) for r in ("admin", "user")])
    report.created.append(f"user {BOOTSTRAP_USER}")
    report.notices.append(
        f"bootstrap admin user '{BOOTSTRAP_USER}' created; password (shown once): {password} "
        f"(stored 0600 in {home.secrets / BOOTSTRAP_SECRET})")


def provision_lines(settings: Settings, home: Home) -> list[str]:
    """The `appliance.provisioners` entry point: provision, return the notices to print (and what
    was brought back to the settings' values)."""
    report = provision(settings, home)
    return [*report.notices, *(f"Keycloak {what} set as the settings say" for what in report.updated)]
