"""Test helpers for the running appliance's Keycloak: users, clients, real tokens, and a realm
key of our own so crafted tokens carry a signature the gateway trusts."""

from __future__ import annotations

import base64
import json
import ssl
import time
from dataclasses import dataclass, field
from functools import cached_property

import httpx
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from jwcrypto import jwk, jws
from keycloak import KeycloakAdmin

from appliance.secrets import secret
from appliance.settings import Settings, load_settings
from appliance.tls import keycloak_ssl
from installer.realm import BOOTSTRAP_SECRET, master_admin
from tests.integration.conftest import Running


@dataclass
class Realm:
    running: Running
    _admin: tuple[float, str] | None = field(default=None, init=False, repr=False)  # (renew after, token)

    @cached_property
    def settings(self) -> Settings:
        return load_settings(self.running.appliance.home.settings_file, environ=self.running.appliance.env)

    @property
    def issuer(self) -> str:
        return self.settings.keycloak.issuer

    @cached_property
    def tls(self) -> ssl.SSLContext:
        """Trusts Keycloak's certificate the way the appliance's own clients do."""
        return keycloak_ssl(self.settings, self.running.appliance.home)

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.settings.gateway.port}"

    @cached_property
    def admin(self) -> KeycloakAdmin:
        return master_admin(self.settings, self.running.appliance.home)

    def token_response(self, username: str, password: str, client_id: str = "appliance-cli",
                       scope: str | None = None, realm_issuer: str | None = None) -> dict:
        data = {"grant_type": "password", "client_id": client_id, "username": username,
                "password": password}
        if scope:
            data["scope"] = scope
        response = httpx.post(f"{realm_issuer or self.issuer}/protocol/openid-connect/token", data=data,
                              timeout=30, verify=self.tls)
        response.raise_for_status()
        return response.json()

    def token(self, username: str, password: str, **kwargs: str) -> str:
        return self.token_response(username, password, **kwargs)["access_token"]

    def admin_token(self) -> str:
        """The administrator's access token, fetched again only when it has under 30 s left: one
        password login a module, not one a call (each login is a chance for another module's
        wrong password on the shared realm to meet this one)."""
        if self._admin is None or time.monotonic() > self._admin[0]:
            answer = self.token_response("admin", secret(self.running.appliance.home, BOOTSTRAP_SECRET))
            self._admin = (time.monotonic() + int(answer["expires_in"]) - 30, answer["access_token"])
        return self._admin[1]

    def ensure_user(self, username: str, password: str, roles: list[str]) -> str:
        user_id = self.admin.get_user_id(username)
        if user_id is None:
            user_id = self.admin.create_user({
                "username": username, "enabled": True, "emailVerified": True,
                "firstName": username, "lastName": "Test", "email": f"{username}@test.local",
                "credentials": [{"type": "password", "value": password, "temporary": False}]})
            if roles:
                self.admin.assign_realm_roles(user_id, [self.admin.get_realm_role(r) for r in roles])
        return user_id

    def ensure_client(self, client_id: str, **extra: object) -> None:
        if self.admin.get_client_id(client_id) is None:
            self.admin.create_client({"clientId": client_id, "publicClient": True,
                                      "directAccessGrantsEnabled": True, "standardFlowEnabled": False,
                                      **extra})

    @cached_property
    def trusted_key(self) -> jwk.JWK:
        """An RSA key added to the realm (lowest priority, so Keycloak never signs with it)."""
        private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()).decode()
        realm_id = self.admin.get_realm(self.settings.keycloak.realm)["id"]
        self.admin.create_component({
            "name": "test-crafted-tokens", "providerId": "rsa",
            "providerType": "org.keycloak.keys.KeyProvider", "parentId": realm_id,
            "config": {"priority": ["1"], "enabled": ["true"], "active": ["true"],
                       "algorithm": ["RS256"], "privateKey": [pem]}})
        key = jwk.JWK.from_pem(pem.encode())
        n = key.export_public(as_dict=True)["n"]
        certs = httpx.get(f"{self.issuer}/protocol/openid-connect/certs", timeout=10, verify=self.tls).json()
        [kid] = [k["kid"] for k in certs["keys"] if k.get("n") == n]
        self._trusted_kid = kid
        return key

    def craft(self, claims: dict, *, key: jwk.JWK | None = None, kid: str | None = None,
              alg: str = "RS256") -> str:
        """A JWS over `claims`, by default signed with the realm-trusted key."""
        signer = key or self.trusted_key
        header = {"alg": alg, "typ": "JWT", "kid": kid if kid is not None else self._trusted_kid}
        token = jws.JWS(json.dumps(claims).encode())
        token.add_signature(signer, alg=alg, protected=json.dumps(header))
        return token.serialize(compact=True)

    def good_claims(self, sub: str = "f0e1d2c3-0000-4000-8000-000000000001", **changes: object) -> dict:
        now = int(time.time())
        claims = {"iss": self.issuer, "aud": [self.settings.keycloak.gateway_client_id, "account"],
                  "sub": sub, "typ": "Bearer", "azp": "appliance-cli", "exp": now + 300, "iat": now,
                  "jti": f"crafted-{now}-{id(changes)}", "preferred_username": "crafted",
                  "realm_access": {"roles": ["user"]}}
        claims.update(changes)
        return {k: v for k, v in claims.items() if v is not None}


def b64(data: dict | bytes) -> str:
    raw = data if isinstance(data, bytes) else json.dumps(data).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def parts(token: str) -> tuple[dict, dict, str]:
    head, body, sig = token.split(".")
    decode = lambda s: json.loads(base64.urlsafe_b64decode(s + "=" * (-len(s) % 4)))  # noqa: E731
    return decode(head), decode(body), sig
