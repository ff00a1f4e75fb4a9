"""Provision realm `appliance` in the embedded Keycloak, idempotently, via its admin API.

Realm roles admin/user/trainer/auditor; a confidential gateway client whose service account may
manage users (the admin API goes through it); a public CLI client with the device grant whose
tokens carry the gateway in `aud`; a bootstrap admin user whose generated password is stored
0600 and reported once, when it is created.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from keycloak import KeycloakAdmin, KeycloakOpenIDConnection
from keycloak.exceptions import KeycloakError as KcError

from appliance.errors import ApplianceError
from appliance.home import Home
from appliance.roles import Role
from appliance.secrets import gateway_client_secret, rl_client_secret, secret
from appliance.settings import Settings
from appliance.tls import keycloak_trust
from installer.keycloak import ADMIN_SECRET, ADMIN_USER

ROLES = tuple(Role)
BOOTSTRAP_USER = "admin"
BOOTSTRAP_SECRET = "bootstrap-admin-password"
# What the gateway's service account may do in realm-management: list and manage users.
SERVICE_ROLES = ("view-users", "manage-users", "query-users", "view-realm")
ACCESS_TOKEN_LIFESPAN_S = 300


class ProvisionError(ApplianceError):
    """Keycloak refused a provisioning step."""


@dataclass
class ProvisionReport:
    created: list[str] = field(default_factory=list)
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
            admin.create_realm({"realm": realm, "enabled": True,
                                "accessTokenLifespan": ACCESS_TOKEN_LIFESPAN_S}, skip_exists=True)
            report.created.append(f"realm {realm}")
        admin.connection.realm_name = realm
        for role in ROLES:
            if admin.create_realm_role({"name": role}, skip_exists=True):
                report.created.append(f"role {role}")
        _gateway_client(admin, settings, home, report)
        _cli_client(admin, settings, report)
        _rl_client(admin, settings, home, report)
        _bootstrap_admin(admin, home, report)
    except KcError as exc:
        raise ProvisionError(f"Keycloak refused provisioning realm {keycloak.realm}: {exc}",
                             log=home.logs / "keycloak.log") from exc
    return report


def _service_account(admin: KeycloakAdmin, client_id: str, client_secret: str, report: ProvisionReport,
                     **extra: object) -> str:
    """A confidential client with a service account and no other grant, made if missing; its
    service account's user id."""
    if admin.get_client_id(client_id) is None:
        admin.create_client({
            "clientId": client_id, "protocol": "openid-connect", "publicClient": False,
            "secret": client_secret, "serviceAccountsEnabled": True,
            "standardFlowEnabled": False, "directAccessGrantsEnabled": False, **extra,
        }, skip_exists=True)
        report.created.append(f"client {client_id}")
    return str(admin.get_client_service_account_user(_client_uuid(admin, client_id))["id"])


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
    keycloak = settings.keycloak
    if admin.get_client_id(keycloak.cli_client_id) is not None:
        return
    admin.create_client({
        "clientId": keycloak.cli_client_id, "protocol": "openid-connect", "publicClient": True,
        "standardFlowEnabled": False, "directAccessGrantsEnabled": True,
        "attributes": {"oauth2.device.authorization.grant.enabled": "true"},
        "protocolMappers": [_gateway_audience(settings)],
    }, skip_exists=True)
    report.created.append(f"client {keycloak.cli_client_id}")


def _rl_client(admin: KeycloakAdmin, settings: Settings, home: Home, report: ProvisionReport) -> None:
    """The RL loop's service identity: a confidential client whose service account has role `user`
    and whose tokens carry the gateway in `aud`, so its generations are authenticated, rate-limited
    and audited as any user's."""
    account = _service_account(admin, settings.rl.client_id, rl_client_secret(home), report,
                               protocolMappers=[_gateway_audience(settings)])
    if Role.USER not in {r["name"] for r in admin.get_realm_roles_of_user(account)}:
        admin.assign_realm_roles(account, [admin.get_realm_role(Role.USER)])


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
    """The `appliance.provisioners` entry point: provision, return the notices to print."""
    return provision(settings, home).notices
