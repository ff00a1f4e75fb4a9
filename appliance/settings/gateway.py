"""The gateway's settings: where and how it listens (TLS, public URL, timeouts, proxies) and the
per-role limits of its users."""

from __future__ import annotations

import ipaddress
import urllib.parse
from typing import Literal

from pydantic import Field, field_validator, model_validator

from appliance.settings.section import DNS_NAME, Port, Section, is_address, is_loopback

WHOLE_CONTEXT = 1 << 24  # a max_tokens cap past any model's context (16M tokens): the whole context


class RoleLimits(Section):
    """Per-user limits for users whose best role is this one."""

    # The bounds are far past any use; without them a 400-digit integer validates and then fails
    # every request of the role (float division overflows).
    requests_per_minute: int = Field(600, gt=0, le=10**9, description="Requests a user may make per minute.")
    tokens_per_minute: int = Field(
        200_000, gt=0, le=10**12, description="Prompt + completion tokens a user may use per minute; a request "
        "reserves its worst case (prompt + max_tokens x n) when admitted, the unused rest is refunded."
    )
    max_concurrent: int = Field(16, gt=0, le=10**6, description="Requests a user may have in flight at once.")
    max_tokens: int = Field(
        4096, gt=0, le=10**9, description="Largest max_tokens (or max_completion_tokens) a request may ask for, and "
        "what a request asking none gets; past it the request is refused (400). Never more than the "
        "model's context: a value at or above it allows the whole context."
    )
    max_n: int = Field(4, gt=0, le=10**4, description="Largest n (choices per request).")
    max_logprobs: int = Field(
        5, ge=0, le=10**4, description="Largest logprobs / top_logprobs / prompt_logprobs a request may ask for."
    )


def default_limits() -> dict[str, RoleLimits]:
    """The roles' limits where the settings give none: a plain user's, and an administrator's."""
    return {"user": RoleLimits(), "admin": RoleLimits(
        requests_per_minute=6000, tokens_per_minute=2_000_000, max_concurrent=64, max_tokens=WHOLE_CONTEXT,
        max_n=16, max_logprobs=20)}


class GatewaySettings(Section):
    """The public, authenticated OpenAI-compatible endpoint."""

    bind: str = Field(
        "127.0.0.1", description="Address the gateway listens on; 0.0.0.0 (or a network address) serves the "
        "network, over HTTPS (see tls)."
    )
    port: Port = Field(8080, description="Gateway port.")
    tls: Literal["auto", "on", "off"] = Field(
        "auto", description="HTTPS: auto serves it exactly when bind is not a loopback address; off on a "
        "network address needs allow_plain_http."
    )
    allow_plain_http: bool = Field(
        False, description="Let the gateway serve plain HTTP on a network address (tls = off): every bearer "
        "token and prompt crosses the network in clear. Only behind a TLS-terminating proxy on a trusted segment."
    )
    certificate: str | None = Field(
        None, description="PEM file of the organisation's certificate for the gateway, its chain after it "
        "(leaf first); unset: the appliance's CA issues one for `names`."
    )
    private_key: str | None = Field(
        None, description="PEM file of the private key of `certificate` (0600, unencrypted)."
    )
    names: list[str] = Field(
        default_factory=list, description="Host names and addresses clients reach the gateway by, named in "
        "the certificate the appliance's CA issues (localhost, 127.0.0.1 and a specific bind address always are)."
    )
    public_url: str | None = Field(
        None, description="https://HOST[:PORT] at which users and applications on other machines reach the "
        "gateway. Set, the embedded Keycloak's login endpoints (token, device login and its page, keys) are "
        "published through the gateway under /realms/ and /resources/, and every token names it as issuer."
    )
    login_attempts_per_minute: float = Field(
        30.0, gt=0, le=6000, description="With public_url: requests to the published login endpoints (token, "
        "device login, login pages) one source address may make a minute, after login_burst; more are refused "
        "(429 with Retry-After) and audited. Keycloak's lockout is per account: this is per address.")
    login_burst: int = Field(
        20, ge=1, le=10000, description="Requests to the published login endpoints one source address may make "
        "at once before login_attempts_per_minute applies.")
    max_body_bytes: int = Field(1_048_576, gt=0, description="Largest request body accepted.")
    leeway_s: int = Field(30, ge=0, le=300, description="Clock skew allowed on exp/nbf.")
    jwks_refetch_interval_s: int = Field(
        30, ge=1, description="Least time between JWKS refetches on an unknown key id."
    )
    upstream_connect_timeout_s: float = Field(
        1.0, gt=0, description="Engine connect timeout; a down engine is a fast 503."
    )
    header_timeout_s: float = Field(
        10.0, gt=0, description="A connection must send its request headers within this time of opening "
        "(or of its previous response) or it is closed."
    )
    body_timeout_s: float = Field(
        20.0, gt=0, description="A request body must arrive within this time of its headers, plus a second "
        "for every `body_min_rate` bytes delivered, or the connection is closed."
    )
    body_min_rate: float = Field(
        4096.0, gt=0, description="Bytes a second a request body must keep up after `body_timeout_s`."
    )
    send_timeout_s: float = Field(
        30.0, gt=0, description="A client must read what it is sent: a connection whose send buffer stays "
        "full this long is closed."
    )
    max_connections: int = Field(
        4096, ge=16, description="Open connections at most; past it the oldest still sending its headers "
        "(or, if none is, its body) is closed."
    )
    trusted_proxies: list[str] = Field(
        default_factory=list, description="Addresses or networks (CIDR) of the reverse proxies whose "
        "X-Forwarded-For names the client; from anyone else it is ignored and the peer is the source. "
        "Empty (the default): no proxy is trusted, not even on loopback."
    )
    introspect_ttl_s: float = Field(
        10.0, ge=0,
        description="Re-check each token with Keycloak's introspection this often (0: never), "
        "so a disabled user's unexpired token stops working within this time.",
    )
    limits: dict[str, RoleLimits] = Field(
        default_factory=default_limits,
        description="Rate limits by role (the most generous role a user holds applies). The roles and fields "
        "given replace the defaults' own; the rest keep them.",
    )


    @field_validator("limits", mode="before")
    @classmethod
    def _over_the_defaults(cls, given: object) -> object:
        """Each role's fields given over that role's defaults, and the roles not given kept: a file
        that sets `limits.user.requests_per_minute` alone must not drop the admin role's limits (its
        users would then be held to the user role's) nor set the admin role's other fields to a plain
        role's."""
        if not isinstance(given, dict):
            return given
        merged: dict[object, object] = {role: limits.model_dump() for role, limits in default_limits().items()}
        for role, fields in given.items():
            base = merged.get(role)
            merged[role] = {**base, **fields} if isinstance(base, dict) and isinstance(fields, dict) else fields
        return merged

    @field_validator("names")
    @classmethod
    def _certificate_names(cls, names: list[str]) -> list[str]:
        """Each an IP address or a DNS name of ASCII letters, digits and hyphens (a name that only looks
        like another, or a wildcard, is refused)."""
        for position, name in enumerate(names):
            try:
                ipaddress.ip_address(name)
            except ValueError:
                if not DNS_NAME.fullmatch(name):
                    raise ValueError(f"entry {position} ({name[:80]!r}) is neither an IP address nor a DNS name "
                                     "(letters a-z, digits and hyphens, labels split by dots)") from None
        return [name.lower() for name in names]

    @field_validator("public_url")
    @classmethod
    def _public_url(cls, url: str | None) -> str | None:
        """https://HOST[:PORT] and nothing more, the host a DNS name or an IP address."""
        if url is None:
            return None
        parsed = urllib.parse.urlsplit(url)
        try:
            port = parsed.port
        except ValueError:
            port = -1
        host = parsed.hostname or ""
        if (parsed.scheme != "https" or parsed.path not in ("", "/") or parsed.query or parsed.fragment
                or parsed.username is not None or parsed.password is not None or port == -1
                or not (DNS_NAME.fullmatch(host) or is_address(host))):
            raise ValueError(f"{url[:120]!r} is not https://HOST[:PORT] (a DNS name or address, no path, "
                             "user or query)")
        shown = f"[{host}]" if ":" in host else host
        return f"https://{shown.lower()}{f':{port}' if port else ''}"

    @model_validator(mode="after")
    def _no_clear_tokens_on_the_network(self) -> GatewaySettings:
        if (self.certificate is None) != (self.private_key is None):
            raise ValueError("certificate and private_key go together: set both (the organisation's) or neither "
                             "(the appliance's CA issues one)")
        if self.public_url and not self.https:
            raise ValueError("public_url is served over HTTPS: set tls to auto with a network bind, or on")
        if self.tls == "off" and not is_loopback(self.bind) and not self.allow_plain_http:
            raise ValueError(f"bind {self.bind} is a network address and tls is off: every bearer token would "
                             "cross the network in clear; set tls to auto (HTTPS), or allow_plain_http = true "
                             "behind a TLS-terminating proxy")
        return self

    @property
    def https(self) -> bool:
        """Whether the gateway serves HTTPS."""
        return self.tls == "on" or (self.tls == "auto" and not is_loopback(self.bind))

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, proxies: list[str]) -> list[str]:
        """Each an IP address or network, written canonically ("*" and host names are refused:
        trusting everyone lets any client choose its recorded source)."""
        canonical = []
        for position, proxy in enumerate(proxies):
            try:
                canonical.append(str(ipaddress.ip_network(proxy, strict=True)))
            except ValueError as exc:
                raise ValueError(f"entry {position} is not an IP address or network ({exc})") from None
        return canonical
