"""The identity provider's settings: the appliance's own Keycloak (its database, lockouts) or the
organisation's."""

from __future__ import annotations

import re
import urllib.parse
from typing import Literal

from pydantic import Field, PrivateAttr, model_validator

from appliance.settings.section import Port, Section

_PG_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})")
_PG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,62}")
_PG_CA_FILE = re.compile(r"/[A-Za-z0-9/._-]{1,4095}")


class KeycloakSettings(Section):
    """The identity provider: the appliance's own Keycloak, or the organisation's."""

    mode: Literal["embedded", "external"] = Field(
        "embedded",
        description="embedded: the appliance runs and provisions Keycloak; external: use url.",
    )
    url: str | None = Field(
        None, description="Base URL of an external Keycloak (external mode), e.g. https://idp:8443."
    )
    realm: str = Field("appliance", description="Realm whose tokens the gateway accepts.")
    port: Port = Field(8180, description="Loopback HTTPS port of the embedded Keycloak (the appliance's "
                       "own CA issues its certificate; there is no plain-HTTP listener).")
    management_port: Port = Field(9180, description="Health endpoints of the embedded Keycloak.")
    database: Literal["dev-file", "postgres"] = Field(
        "postgres", description="The embedded Keycloak's database: postgres, a PostgreSQL server the appliance "
        "supervises on loopback (its password generated, 0600; an appliance still on dev-file has its realms "
        "moved over at `up`); dev-file, Keycloak's H2 file, which its production guide says not to use in "
        "production.")
    postgres_port: Port = Field(5433, description="Loopback port of the supervised PostgreSQL (database = postgres).")
    postgres_url: str | None = Field(
        None, description="An external PostgreSQL for the embedded Keycloak instead of the supervised one: "
        "postgresql://USER@HOST[:PORT]/DATABASE (no password in it). Reached over TLS with the server's certificate "
        "verified against postgres_ca_file and its host name checked (sslmode verify-full).")
    postgres_password_file: str | None = Field(
        None, description="With postgres_url: the file (0600) holding USER's password.")
    postgres_ca_file: str | None = Field(
        None, description="With postgres_url: the PEM file of the CA(s) that issued the server's certificate.")
    ca_file: str | None = Field(
        None, description="External mode: PEM file of the CA(s) that issued the external Keycloak's "
        "certificate (unset: the system's trust store)."
    )
    java_home: str | None = Field(
        None, description="JDK for the embedded Keycloak (unset: Temurin 25 if present, else 17)."
    )
    gateway_client_id: str = Field("appliance-gateway", description="Confidential client of the gateway.")
    gateway_client_secret: str | None = Field(
        None,
        description="External mode: the gateway client's secret (embedded mode generates one).",
    )
    cli_client_id: str = Field("appliance-cli", description="Public client (device grant) for the CLI/TUI.")
    cli_password_grant: bool = Field(
        True, description="The CLI client also takes a password (`appliance token --user --password-stdin`, "
        "for scripts); false: device grant only. No other client of the realm takes one.")
    start_timeout_s: int = Field(300, gt=0, description="How long `up` waits for Keycloak.")
    password_policy: str = Field(
        "length(12) and maxLength(128) and notUsername and notEmail",
        description="The realm's password policy (Keycloak's syntax), checked whenever a password is set.")
    # Keycloak's brute-force detection: a lockout is always temporary (a permanent one would let
    # anyone who knows a username disable the account).
    lockout_failures: int = Field(5, ge=1, le=100, description="Wrong passwords for one account (none further "
                                  "apart than lockout_reset_s) that lock it for a while.")
    lockout_wait_s: int = Field(60, ge=1, le=86400, description="How long lockout_failures wrong passwords lock "
                                "the account; each further lockout_failures add as much again.")
    lockout_max_wait_s: int = Field(900, ge=1, le=86400, description="The longest lockout.")
    lockout_reset_s: int = Field(43200, ge=60, description="Wrong passwords are forgotten after this long "
                                 "without another (a successful login forgets them at once).")
    quick_login_check_ms: int = Field(1000, ge=0, le=60000, description="Two wrong passwords for one account "
                                      "closer together than this (a script guessing)...")
    quick_login_wait_s: int = Field(60, ge=1, le=86400, description="...lock it this long at once.")
    events_poll_s: float = Field(
        10.0, ge=0, le=3600, description="How often the gateway copies Keycloak's failed logins, lockouts and "
        "admin events into the audit log (0: never).")

    @property
    def base_url(self) -> str:
        """Keycloak's base URL: the external one, or the embedded one on loopback."""
        if self.mode == "external" and self.url:
            return self.url.rstrip("/")
        return f"https://127.0.0.1:{self.port}"

    # Where users' browsers and other machines reach the embedded Keycloak: the gateway's
    # public_url (Settings sets it), else nowhere but here.
    _frontend: str | None = PrivateAttr(default=None)

    @property
    def issuer(self) -> str:
        """The realm's `iss`, exactly as it appears in its tokens (its frontend URL)."""
        return f"{self._frontend or self.base_url}/realms/{self.realm}"

    @property
    def realm_url(self) -> str:
        """Where this host's processes reach the realm's endpoints (token, keys, introspection)."""
        return f"{self.base_url}/realms/{self.realm}"

    @property
    def frontend_url(self) -> str | None:
        """The embedded Keycloak's public base URL, published through the gateway; None: loopback only."""
        return self._frontend

    @property
    def external_postgres(self) -> urllib.parse.SplitResult | None:
        """postgres_url, parsed (checked by the validator), or None for the supervised server."""
        return urllib.parse.urlsplit(self.postgres_url) if self.postgres_url else None

    @model_validator(mode="after")
    def _external_postgres_complete(self) -> KeycloakSettings:
        url = self.external_postgres
        if url is None:
            if self.postgres_password_file or self.postgres_ca_file:
                raise ValueError("postgres_password_file and postgres_ca_file go with postgres_url")
            return self
        if self.database != "postgres":
            raise ValueError("postgres_url needs database = \"postgres\"")
        try:
            port = url.port
        except ValueError:
            port = -1
        database = url.path.removeprefix("/")
        if url.password is not None:
            raise ValueError("postgres_url holds a password: put it in postgres_password_file (0600) instead")
        # What reaches Keycloak's JDBC URL: plain names only, or a parameter could ride along (socketFactory=...).
        if (url.scheme != "postgresql" or port == -1 or not _PG_HOST.fullmatch(url.hostname or "")
                or not _PG_NAME.fullmatch(url.username or "") or not _PG_NAME.fullmatch(database)
                or url.query or url.fragment):
            raise ValueError(f"postgres_url {self.postgres_url!r}: use postgresql://USER@HOST[:PORT]/DATABASE "
                             "(a host name or IPv4 address; USER and DATABASE of letters, digits, _ and -)")
        if not (self.postgres_password_file and self.postgres_ca_file):
            raise ValueError("postgres_url needs postgres_password_file and postgres_ca_file (the server's "
                             "certificate is always verified)")
        if not _PG_CA_FILE.fullmatch(self.postgres_ca_file):
            raise ValueError(f"postgres_ca_file {self.postgres_ca_file!r}: an absolute path of letters, digits and "
                             "/._- (it becomes part of Keycloak's JDBC URL)")
        return self

    @model_validator(mode="after")
    def _external_needs_url(self) -> KeycloakSettings:
        if self.mode != "external":
            return self
        if not (self.url and self.gateway_client_secret):
            raise ValueError("external mode needs url and gateway_client_secret")
        if not self.url.lower().startswith("https://"):
            # The gateway sends its client secret there and trusts the keys it serves.
            raise ValueError(f"url {self.url!r}: an external Keycloak must be reached over https://")
        return self
