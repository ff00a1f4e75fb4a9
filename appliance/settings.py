"""Typed settings: a TOML file in the state directory, then APPLIANCE_* environment overrides.

Every field has a default, a constraint and a one-line description; `appliance settings defaults`
prints them as a commented TOML file. Loading does no I/O beyond reading the file and the
environment. Errors name the source (file and line, or the environment variable), the field and
the reason.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import re
import tomllib
import urllib.parse
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import tomli_w
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    IPvAnyAddress,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from appliance.errors import SettingsError
from appliance.home import BACKUP_PASSPHRASE_ENV, HOME_ENV

ENV_PREFIX = "APPLIANCE_"
# Not settings: APPLIANCE_HOME picks the state directory itself; a backup passphrase (appliance.home).
_ENV_NOT_SETTINGS = {HOME_ENV, BACKUP_PASSPHRASE_ENV}

DEMO_MODEL = "demo"
Port = Annotated[int, Field(ge=1024, le=65535)]


_DNS_NAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?", re.ASCII)


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    """Whether a listener bound to `host` is reachable from this host only: a loopback address (a
    name, even `localhost`, is whatever the resolver says, so it is not)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_URL_TAIL = re.compile(r"[A-Za-z0-9._~!$&'()*+,;=:@%/?-]*", re.ASCII)  # RFC 3986's path and query characters
_CONFIG_COMMENT = re.compile(r"\s[;#]")  # supervisord's config reads these as the start of a comment


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)
    # Values of these sections reach supervisord's configuration file (commands, environments).
    IN_SUPERVISOR_CONFIG: ClassVar[bool] = True

    @field_validator("*", mode="after")
    @classmethod
    def _no_line_injection(cls, value: Any) -> Any:
        for text in _strings(value):
            if found := _CONTROL.search(text):
                raise ValueError(f"contains a control character (U+{ord(found.group()):04X}); a line break "
                                 "would start a new line in supervisord's configuration")
            if cls.IN_SUPERVISOR_CONFIG and (found := _CONFIG_COMMENT.search(text)):
                raise ValueError(f"contains {found.group()!r}: supervisord's configuration would read the rest "
                                 "as a comment")
        return value


class EngineSettings(_Section):
    """Defaults for every vLLM pool."""

    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="cuda if an NVIDIA driver is present (auto), or force cpu/cuda."
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] | None = Field(
        None, description="Weight and activation dtype passed to vLLM --dtype (unset: bfloat16 on cuda; float32 "
        "on cpu, where vLLM's bfloat16 kernels on AMX hosts changed the demo model's greedy answers)."
    )
    max_model_len: int = Field(2048, gt=0, description="Longest sequence (prompt + output) in tokens.")
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Fraction of accelerator memory for vLLM (unset: 0.9 on cuda; on cpu 0.3 "
        "of the NUMA node's RAM, vLLM's default refuses to start on small hosts).",
    )
    cpu_kvcache_gib: int = Field(1, gt=0, description="KV-cache size on the CPU engine, GiB.")
    enforce_eager: bool | None = Field(
        None,
        description="Skip graph capture / torch.compile (unset: on for cpu, where it halves "
        "start-up; off for cuda).",
    )
    start_timeout_s: int = Field(
        600, gt=0, description="How long `appliance up` waits for an engine to answer."
    )
    yield_nice: int = Field(19, ge=0, le=19, description="While `up` starts the appliance, the programs the "
                            "engines do not need (Keycloak, its PostgreSQL, Prometheus, Alertmanager, the queue "
                            "workers) run at this CPU niceness, so that the engines load first where cores are few; "
                            "`up` returns them to 0 once all are ready (that needs root or CAP_SYS_NICE; `up` says if "
                            "it could not). 0: all start alike.")
    isolate_network: bool = Field(
        True, description="Run each engine in a network namespace of its own (loopback only): the ports "
        "vLLM opens inside (ZMQ, torch.distributed) are out of every other local process's reach; "
        "the engine is reached only through its Unix socket. Ranks of a pool spanning hosts cannot be: they "
        "talk to the other hosts' over the cluster network (see cluster)."
    )


class PoolSettings(_Section):
    """One vLLM server: a model served under a name, on a Unix socket in the state dir's private
    run/engines/ (no TCP port: no other local user can reach the engine or take its place)."""

    name: str = Field(
        pattern=r"^[a-z][a-z0-9-]{0,30}$",
        description="Pool name; its supervised program is vllm-<name>.",
    )
    model: str = Field(
        DEMO_MODEL,
        description="'demo' (the bundled SmolLM2-135M-Instruct) or a path to an HF-format "
        "checkpoint directory.",
    )
    served_model_name: str | None = Field(
        None, description="Name clients use in 'model' (unset: the model directory's name)."
    )
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM --tensor-parallel-size.")
    pipeline_parallel_size: int = Field(1, ge=1, description="vLLM --pipeline-parallel-size.")
    data_parallel_size: int = Field(1, ge=1, description="vLLM --data-parallel-size.")
    enable_expert_parallel: bool = Field(False, description="vLLM --enable-expert-parallel.")
    gpus: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, description="GPU indexes the pool holds on this host (unset: its plan's, else chosen from the free "
        "GPUs, TP groups inside one NVLink domain and NUMA node). Pools may not share GPUs."
    )
    tier: str | None = Field(
        None, pattern=r"^[a-z][a-z0-9-]{0,15}$",
        description="The tier of its model this pool serves (e.g. fast, full): pools serving one model name each "
        "name a tier of their own; clients ask for `MODEL:TIER`, or for `MODEL` and the routing policy picks."
    )
    replicas: int = Field(
        1, ge=1, le=32, description="Engines serving the pool side by side (vLLM data parallel as separate "
        "engines, programs vllm-<name>, vllm-<name>_1, ...); the gateway balances requests over them. With GPUs "
        "set, they are split among the replicas in order."
    )
    enable_lora: bool = Field(False, description="Serve LoRA adapters (runtime loading on).")
    max_lora_rank: int = Field(16, ge=1, description="Largest adapter rank accepted.")
    max_loras: int = Field(4, ge=1, description="Adapters resident at once.")
    max_model_len: int | None = Field(None, gt=0, description="Overrides engine.max_model_len.")
    plan: str | None = Field(
        None, description="A plan file (`appliance plan MODEL ... --json > FILE`): its TP/PP/DP/EP layout, "
        "context length and GPU sets replace the sizes above. A plan spanning hosts needs cluster.bind and its "
        "workers joined (`appliance hosts add`, `appliance join`)."
    )
    extra_args: list[str] = Field(
        default_factory=list, description="Further vLLM arguments, appended verbatim."
    )


_PG_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})")
_PG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,62}")
_PG_CA_FILE = re.compile(r"/[A-Za-z0-9/._-]{1,4095}")
_LIBRARY_PATH = re.compile(r"/[A-Za-z0-9/._+-]{1,4095}", re.ASCII)


class KeycloakSettings(_Section):
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


WHOLE_CONTEXT = 1 << 24  # a max_tokens cap past any model's context (16M tokens): the whole context


class RoleLimits(_Section):
    """Per-user limits for users whose best role is this one."""

    requests_per_minute: int = Field(600, gt=0, description="Requests a user may make per minute.")
    tokens_per_minute: int = Field(
        200_000, gt=0, description="Prompt + completion tokens a user may use per minute; a request "
        "reserves its worst case (prompt + max_tokens x n) when admitted, the unused rest is refunded."
    )
    max_concurrent: int = Field(16, gt=0, description="Requests a user may have in flight at once.")
    max_tokens: int = Field(
        4096, gt=0, description="Largest max_tokens (or max_completion_tokens) a request may ask for, and "
        "what a request asking none gets; past it the request is refused (400). Never more than the "
        "model's context: a value at or above it allows the whole context."
    )
    max_n: int = Field(4, gt=0, description="Largest n (choices per request).")
    max_logprobs: int = Field(
        5, ge=0, description="Largest logprobs / top_logprobs / prompt_logprobs a request may ask for."
    )


class ClusterSettings(_Section):
    """Pools that span hosts: the head's listener for workers joining (`appliance hosts add`, then
    `appliance join` on the worker), their heartbeats and weights. Off unless `bind` is set; the
    ranks of such pools talk over this network with vLLM's own (unauthenticated) channels, so it
    must be a dedicated, trusted cluster network."""

    bind: IPvAnyAddress | None = Field(
        None, description="Address on the cluster network the head listens on for workers (HTTPS, the "
        "appliance's own CA); unset: no pool may span hosts."
    )
    port: Port = Field(8443, description="Port of the head's cluster listener.")
    join_token_ttl_s: int = Field(3600, ge=60, le=7 * 86400, description="How long a join token is valid.")
    heartbeat_s: float = Field(0.2, gt=0, le=10, description="How often a worker reports its ranks.")
    dead_after_s: float = Field(
        1.0, gt=0, le=60, description="A worker silent this long is dead: its pools answer 503 until it is back."
    )


class GatewaySettings(_Section):
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
        default_factory=lambda: {"user": RoleLimits(), "admin": RoleLimits(
            requests_per_minute=6000, tokens_per_minute=2_000_000, max_concurrent=64, max_tokens=WHOLE_CONTEXT,
            max_n=16, max_logprobs=20)},
        description="Rate limits by role (the most generous role a user holds applies).",
    )


    @field_validator("names")
    @classmethod
    def _certificate_names(cls, names: list[str]) -> list[str]:
        """Each an IP address or a DNS name of ASCII letters, digits and hyphens (a name that only looks
        like another, or a wildcard, is refused)."""
        for position, name in enumerate(names):
            try:
                ipaddress.ip_address(name)
            except ValueError:
                if not _DNS_NAME.fullmatch(name):
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
                or not (_DNS_NAME.fullmatch(host) or _is_address(host))):
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

class RoutingSettings(_Section):
    """Which pool and which engine of it serve a request: tiers by the routing policy, replicas by
    load and prompt-prefix affinity."""

    IN_SUPERVISOR_CONFIG = False

    interactive_tier: str | None = Field(
        "fast", description="A streamed request for a model's bare name goes to this tier, where the model has it "
        "(unset: to default_tier)."
    )
    default_tier: str = Field(
        "full", description="Other requests for a bare name (not streamed, long prompts, batches) go to this tier, "
        "where the model has it; a model without it answers from its first pool in the settings."
    )
    long_prompt_chars: int = Field(
        8000, gt=0, description="A streamed request whose prompt is longer than this is long-context: it goes to "
        "default_tier."
    )
    balance: Literal["affinity", "least_loaded", "round_robin"] = Field(
        "affinity", description="How a pool's replicas share requests: affinity (the replica that served the "
        "longest prefix of the prompt recently, unless it is busier than the least loaded by more than "
        "affinity_max_skew), least_loaded (fewest in flight) or round_robin."
    )
    affinity_block_bytes: int = Field(
        256, ge=16, le=65536, description="Prompt prefixes are remembered in blocks of this many bytes (UTF-8).")
    affinity_max_blocks: int = Field(64, ge=1, le=4096, description="Blocks remembered of one prompt at most.")
    affinity_max_skew: int = Field(
        4, ge=0, description="Requests in flight the affinity replica may have above the least loaded one.")
    affinity_entries: int = Field(65536, ge=16, description="Prefix blocks remembered at most (oldest forgotten).")


class CacheSettings(_Section):
    """The gateway's exact-match response cache for deterministic requests (temperature 0 or a seed)."""

    IN_SUPERVISOR_CONFIG = False

    enabled: bool = Field(True, description="Answer repeated deterministic requests from the cache.")
    scope: Literal["user", "role"] = Field(
        "user", description="Who shares entries: each user their own (user), or users holding the same roles (role).")
    ttl_s: float = Field(300.0, gt=0, description="How long an entry is served.")
    max_entries: int = Field(4096, ge=1, description="Entries at most (least recently used dropped).")
    max_bytes: int = Field(64 << 20, ge=1024, description="Bytes of answers held at most.")
    max_entry_bytes: int = Field(1 << 20, ge=1024, description="Larger answers are not kept.")


class BackupSettings(_Section):
    """Backups taken on a schedule into the artifact store (`appliance backup create` takes one at any time)."""

    IN_SUPERVISOR_CONFIG = False

    every_hours: float | None = Field(
        None, gt=0, le=24 * 366, description="Take a backup into the artifact store this often, while the appliance "
        "runs (unset: no scheduled backups).")
    keep: int = Field(7, ge=1, le=10000, description="Scheduled backups kept in the store: after each new one, "
                      "older ones beyond this many are removed.")
    key_file: str | None = Field(
        None, description="The key file (0600, at least 12 bytes) whose contents seal scheduled backups; keep a copy "
        "away from the appliance: without it no backup can be restored.")

    @model_validator(mode="after")
    def _schedule_needs_a_key(self) -> BackupSettings:
        if self.every_hours is not None and not self.key_file:
            raise ValueError("every_hours needs key_file: a scheduled backup is sealed with the key file's contents")
        return self


class MonitoringSettings(_Section):
    """Prometheus and Alertmanager under supervisord, on loopback only, each behind a password of
    the appliance's: the metrics, the shipped alert rules, and where alerts go."""

    enabled: bool = Field(True, description="Run Prometheus and Alertmanager (Debian's `prometheus` and "
                          "`prometheus-alertmanager` packages; bootstrap installs them).")
    prometheus_port: Port = Field(9090, description="Prometheus's loopback port.")
    alertmanager_port: Port = Field(9093, description="Alertmanager's loopback port.")
    scrape_interval_s: int = Field(15, ge=1, le=300, description="How often Prometheus scrapes and evaluates the "
                                   "alert rules.")
    retention_days: int = Field(15, ge=1, le=3650, description="Prometheus keeps samples this long...")
    retention_mb: int = Field(2048, ge=64, le=1 << 24, description="...and at most this much disk (the oldest "
                              "blocks go first).")
    webhook_url: str | None = Field(
        None, description="Where Alertmanager posts firing and resolved alerts (its webhook format): an https "
        "URL, or http to a loopback address; unset: alerts are only shown (`appliance alerts`, status, the TUI).")
    nvml_library: str | None = Field(
        None, description="The NVML library the GPU metrics and dashboards read, where the driver's "
        "libnvidia-ml.so.1 is not on the loader's path: an absolute path to a file owned by root (or the "
        "appliance's user) that no one else may write; unset: the loader's.")

    @field_validator("nvml_library")
    @classmethod
    def _nvml_library(cls, path: str | None) -> str | None:
        if path is not None and (not _LIBRARY_PATH.fullmatch(path) or ".." in path.split("/")):
            raise ValueError(f"{path[:120]!r}: an absolute path of letters, digits and . _ + - (no '..' part, "
                             "at most 4096 characters)")
        return path

    @field_validator("webhook_url")
    @classmethod
    def _webhook(cls, url: str | None) -> str | None:
        """http(s)://HOST[:PORT][/PATH]: no user or password in it, plain http to loopback only."""
        if url is None:
            return None
        if len(url) > 2048 or url != url.strip():
            raise ValueError(f"{url[:120]!r}: at most 2048 characters, no space around it")
        parsed = urllib.parse.urlsplit(url)
        try:
            if parsed.port == 0:
                raise ValueError
        except ValueError:
            raise ValueError(f"{url[:120]!r}: its port is not a number from 1 to 65535") from None
        host = parsed.hostname or ""
        if (parsed.scheme not in ("http", "https") or parsed.username is not None or parsed.password is not None
                or parsed.fragment or not (_DNS_NAME.fullmatch(host) or _is_address(host))
                or not _URL_TAIL.fullmatch(f"{parsed.path}{'?' if parsed.query else ''}{parsed.query}")):
            raise ValueError(f"{url[:120]!r} is not http(s)://HOST[:PORT][/PATH][?QUERY] (a DNS name or address, "
                             "no user or password, the path and query in URL characters: others %-escaped)")
        if parsed.scheme == "http" and not is_loopback(host):
            raise ValueError(f"{url[:120]!r}: alerts leave this host over https only (plain http to a loopback "
                             "address)")
        return url

    @model_validator(mode="after")
    def _ports_differ(self) -> MonitoringSettings:
        if self.prometheus_port == self.alertmanager_port:
            raise ValueError("prometheus_port and alertmanager_port must differ")
        return self


class BatchSettings(_Section):
    """OpenAI's Batch API: files, the durable queue and the supervised batch-worker executing it."""

    IN_SUPERVISOR_CONFIG = False

    max_file_bytes: int = Field(64 << 20, ge=1024, le=1 << 30, description="Largest file a client may upload "
                                "(the gateway's max_body_bytes does not apply to /v1/files).")
    max_stored_bytes_per_user: int = Field(
        1 << 30, ge=1024, description="Bytes of files (uploads and batch outputs) a user may hold at once.")
    max_requests: int = Field(50_000, ge=1, description="Requests one batch may hold.")
    max_active_per_user: int = Field(8, ge=1, description="Batches validating or in progress a user may have at "
                                     "once.")
    max_failed_validations_per_hour: int = Field(
        10, ge=1, description="Batches a user may have fail validation (or cancel while validating) in an hour; "
        "past it, creating one is a 429 (each validation reads the whole input file).")
    max_validated_bytes_per_hour: int = Field(
        1 << 30, ge=1, description="Bytes of input files a user's batches created in an hour may hold, whatever "
        "became of them (each validation reads its whole file); past it, creating one is a 429.")
    max_pending_requests_per_user: int = Field(
        200_000, ge=1, description="Requests a user may have waiting over all their batches.")
    concurrency: int = Field(2, ge=1, le=256, description="Requests the worker sends at once.")
    max_attempts: int = Field(3, ge=1, le=20, description="Times a request is sent that the gateway answers 500, "
                              "502 or 504 (an engine failing mid-answer) before that answer is its result.")
    yield_to_interactive: int = Field(
        1, ge=0, description="A batch request waits while its pool has this many interactive requests in flight "
        "or more (0: never waits); interactive traffic goes first.")
    max_yield_s: float = Field(120.0, gt=0, description="A batch request waits this long at most, then goes "
                               "(batches never starve).")
    poll_s: float = Field(1.0, gt=0, le=60, description="How often an idle worker looks for work.")


MASK = "********"
SECRET_FIELDS = (("keycloak", "gateway_client_secret"), ("artifacts", "s3_secret_key"))


class ArtifactSettings(_Section):
    """The artifact store: where copies leave this host's state dir (audit archives first)."""

    IN_SUPERVISOR_CONFIG = False  # read by the programs from the settings file

    store: Literal["local", "s3"] = Field(
        "local", description="'local' (a directory) or 's3' (an S3-compatible bucket via minio)."
    )
    path: str | None = Field(None, description="Directory of the local store (unset: <state dir>/artifacts).")
    s3_endpoint: str | None = Field(None, description="host:port of the S3-compatible server.")
    s3_bucket: str = Field("appliance-artifacts", description="Bucket; created with Object Lock if missing.")
    s3_region: str = Field("us-east-1", description="Region the bucket lives in.")
    s3_secure: bool = Field(True, description="Use HTTPS to the S3 server.")
    s3_access_key: str | None = Field(None, description="S3 access key id.")
    s3_secret_key: str | None = Field(None, description="S3 secret key (masked by the admin API).")

    @model_validator(mode="after")
    def _s3_needs_endpoint_and_keys(self) -> ArtifactSettings:
        if self.store == "s3":
            missing = [f"s3_{name}" for name in ("endpoint", "access_key", "secret_key")
                       if not getattr(self, f"s3_{name}")]
            if missing:
                raise ValueError(f"store 's3' needs {', '.join(missing)}")
        return self


class WatchdogSettings(_Section):
    """The supervised watchdog: an engine replica alive but making no progress is restarted; a
    worker whose training job, RL run or batch work makes no progress is ended, and its work taken
    over by the worker supervisord starts again (bounded retries)."""

    enabled: bool = Field(True, description="Run the watchdog.")
    check_interval_s: float = Field(2.0, ge=0.5, le=300, description="How often it asks every engine replica "
                                    "for its health and its counters.")
    engine_stall_s: float = Field(20.0, ge=5, le=86400, description="A replica whose health check has not "
                                  "answered, or that has held requests without producing a token or filling its "
                                  "KV cache (a long prefill does), for this long is restarted. A replica still "
                                  "starting is not judged until it has answered once or its start timeout has "
                                  "passed.")
    backoff_s: float = Field(60.0, ge=1, le=86400, description="After a replica's restart, its next one waits at "
                             "least this long, doubling with each restart...")
    max_backoff_s: float = Field(900.0, ge=1, le=86400, description="...up to this; a replica that then makes "
                                 "progress this long starts over from backoff_s.")
    training_stall_s: float = Field(1800.0, ge=10, le=604800, description="A training job whose trainer has "
                                    "reported no step (or whose worker has not started it) for this long: its "
                                    "worker is ended, and the job resumes from its last checkpoint.")
    rl_stall_s: float = Field(1800.0, ge=10, le=604800, description="An RL run that has generated and judged "
                              "nothing for this long: its worker is ended, and the run resumes.")
    batch_stall_s: float = Field(1800.0, ge=10, le=604800, description="A batch request or a batch's validation "
                                 "held this long: the batch worker is ended, and its work waits again.")

    @model_validator(mode="after")
    def _backoff_bounds(self) -> WatchdogSettings:
        if self.max_backoff_s < self.backoff_s:
            raise ValueError(f"max_backoff_s ({self.max_backoff_s:g}) is less than backoff_s ({self.backoff_s:g})")
        return self


class AuditSettings(_Section):
    """The tamper-evident audit log."""

    IN_SUPERVISOR_CONFIG = False  # read by the programs from the settings file

    capture_text: bool = Field(
        False, description="Also store raw prompt and completion text (keyed hashes always)."
    )
    checkpoint_every: int = Field(1000, ge=1, description="Sign the chain head every N records...")
    checkpoint_interval_s: float = Field(60.0, gt=0, description="...or every T seconds.")
    max_file_bytes: int = Field(64 << 20, ge=4096, description="Rotate a log file at this size.")
    archive_interval_s: float = Field(
        300.0, ge=0, description="Copy closed log files to the artifact store this often (0: only "
        "by `appliance audit archive`)."
    )
    archive_retention_days: int = Field(
        365, ge=1, description="Object Lock (COMPLIANCE) retention of archived copies on S3."
    )
    refusal_interval_s: float = Field(
        10.0, gt=0, description="Refused requests (4xx) from one source: the first of each status per "
        "interval gets its own record, the rest one summary record with a count at the interval's end."
    )
    monitoring_interval_s: float = Field(
        300.0, gt=0, description="Monitoring reads a dashboard polls (services, host, pools, plans, jobs, "
        "adapters): the first of each per user and interval gets its own record, the rest one record "
        "with a count at the interval's end. Other admin reads (users, settings, the audit log) too, per "
        "user, path and query, when audit.count_repeated_reads: a new query always has its own record."
    )
    count_repeated_reads: bool = Field(
        True, description="Count an admin read repeated with the same query (a screen refreshing) into "
        "its interval's summary record; false records every read of users, settings and the audit log."
    )
    refusal_sources: int = Field(
        256, ge=1, description="Sources tracked apart per interval; refusals from further sources are "
        "summarised together (source '*'), so the log's growth stays bounded."
    )
    archive_require_lock: bool = Field(
        True, description="Refuse to archive to S3 unless the server keeps the Object Lock "
        "retention (false: accept plain, deletable copies, and say so)."
    )


class ExecutionSettings(_Section):
    """The execution sandbox: untrusted programs (a model's answers) run against tests, each in
    a sandbox of its own (`appliance rl exec`)."""

    cpu_s: int = Field(10, ge=1, le=3600, description="CPU seconds per process (then SIGXCPU).")
    wall_s: float = Field(20.0, gt=0, le=3600, description="Wall seconds for one execution, tests included.")
    test_wall_s: float = Field(10.0, gt=0, le=3600, description="Wall seconds for one test.")
    memory_mib: int = Field(512, ge=64, description="Address space per process, MiB.")
    total_memory_mib: int = Field(
        1024, ge=64, description="Memory of all its processes and its /tmp together, MiB (a cgroup, where the "
        "host's memory controller can be used).")
    processes: int = Field(64, ge=4, le=4096, description="Processes and threads of the sandbox's user at once.")
    open_files: int = Field(64, ge=16, le=65536, description="Open files per process.")
    tmpfs_mib: int = Field(64, ge=1, le=65536, description="The only writable place, /tmp, MiB (files and all).")
    output_bytes: int = Field(1_048_576, ge=1024, description="Output past this on stdout or stderr ends it.")
    kept_bytes: int = Field(4096, ge=256, description="Of stdout and stderr each, what a verdict keeps.")
    workers: int | None = Field(
        None, ge=1, le=256, description="Sandbox workers of one RL run at most (they follow the queue's depth); "
        "unset: one per CPU core.")
    worker_idle_s: float = Field(5.0, gt=0, le=3600, description="A sandbox worker with no work ends after this.")


class RlSettings(_Section):
    """Post-training from execution feedback (`appliance rl`): task sets, runs and their rewards."""

    IN_SUPERVISOR_CONFIG = False  # read by the programs from the settings file

    held_out_fraction: float = Field(0.2, ge=0, lt=1, description="Share of a task set's tasks held out.")
    efficiency_weight: float = Field(
        0.1, ge=0, le=1, description="Reward = share of tests passed, plus, for an answer passing them all, this "
        "times the share of its time limit left unused.")
    length_penalty: float = Field(
        0.0, ge=0, le=1, description="Reward less this times the share of max_tokens the answer used (0: "
        "length is not rewarded either way).")
    generation_concurrency: int = Field(4, ge=1, le=256, description="Requests to the gateway at once.")
    segment_attempts: int = Field(64, ge=1, description="Attempts per trajectory segment in the artifact store.")
    client_id: str = Field(
        "appliance-rl", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
        description="The Keycloak client (a service account with role `user`) runs generate under.")
    gateway_timeout_s: float = Field(300.0, gt=0, description="One generation request, at most.")
    give_up_s: float = Field(
        600.0, gt=0, description="How long a generation is retried while the gateway or Keycloak refuse or are "
        "unreachable (429, 502-504) before the run fails.")
    worker_poll_s: float = Field(2.0, gt=0, description="How often the rl-worker looks for queued runs.")
    retry_s: float = Field(30.0, gt=0, description="How long a run waits before it resumes after the gateway, "
                           "Keycloak or the artifact store failed it.")


class FinetuneSettings(_Section):
    """Post-training: datasets, training jobs and their gate (what sensitive data in a dataset gets:
    `compliance.training_data`)."""

    IN_SUPERVISOR_CONFIG = False  # read by the programs from the settings file

    eval_fraction: float = Field(0.1, ge=0, lt=1, description="Share of rows held out for evaluation.")
    gate_min_improvement: float = Field(
        0.0, ge=0, lt=1, description="An adapter passes the gate when its held-out loss is at least this "
        "much lower than the base model's (0.05 = 5 %; 0 = any improvement)."
    )
    gate_min_scenario_score: float = Field(
        0.0, ge=0, le=1, description="With a scenario set: the share of its items the adapter must answer "
        "right (it must also do no worse than the base model)."
    )
    gate_max_regression_drop: float = Field(
        0.05, ge=0, le=1, description="With a regression set: how far the adapter's mean score may fall below "
        "the base model's (forgetting)."
    )
    gate_seeds: int = Field(
        3, ge=1, le=20, description="Each evaluation set is answered this many times, each with its own sampling "
        "seed; the gate judges the mean score and records each seed's and the spread (1: one greedy answer)."
    )
    gate_temperature: float = Field(
        0.5, gt=0, le=2, description="Sampling temperature of the evaluation answers when gate_seeds > 1."
    )
    regression_set: Literal["shipped", "none"] = Field(
        "shipped", description="What a job with no regression set of its own is checked against for forgetting: "
        "the general-capability prompts the appliance ships, or none (forgetting goes unchecked: say so to "
        "your auditor)."
    )
    sandbox: Literal["bubblewrap", "none"] = Field(
        "bubblewrap", description="Run each trainer in a bubblewrap sandbox (as user appliance-train when the "
        "appliance runs as root; only its model, dataset and job directory visible; no network; memory and "
        "process caps); none: a plain child process with the host's view (say so to your auditor)."
    )
    sandbox_memory_gib: float | None = Field(
        None, gt=0, description="The trainer's data memory cap, GiB (unset: 80 % of the host's RAM)."
    )
    sandbox_max_processes: int = Field(
        4096, ge=16, description="Processes and threads the sandbox's user may run at once."
    )
    max_job_hours: float = Field(
        48.0, gt=0, description="A trainer still running after this many hours is ended and its job fails "
        "(each worker's run of it counts on its own): a runaway or hostile trainer that keeps beating cannot "
        "hold the worker for ever."
    )
    processes: int | None = Field(
        None, ge=1, description="Training processes (ranks, torchrun); unset: one per visible GPU, at least one "
        "(`finetune run|submit --processes N` overrides it for a job)."
    )
    strategy: Literal["auto", "fsdp", "ddp", "single"] = Field(
        "auto", description="How several processes train: fsdp shards the base, the adapter and the optimizer "
        "state over them (no process holds the whole base); ddp gives each a whole copy; single trains in one "
        "process. auto: single for one process, otherwise fsdp (ddp for DPO, which the sharded trainer does not run)."
    )
    worker_poll_s: float = Field(2.0, gt=0, description="How often the finetune-worker looks for queued jobs.")


SensitiveAction = Literal["block", "redact", "flag", "allow"]
DEFAULT_PROMPTS: dict[str, SensitiveAction] = {"payment_card": "block", "iban": "block", "secret": "block",
                                               "email": "flag", "phone": "flag", "national_id": "flag"}
DEFAULT_ANSWERS: dict[str, SensitiveAction] = {"payment_card": "redact", "iban": "redact", "secret": "redact",
                                               "email": "flag", "phone": "flag", "national_id": "flag"}


class CompliancePolicy(_Section):
    """What the gateway does with each kind of sensitive data it finds: email, phone, payment_card,
    iban, secret, national_id, and the kinds of `compliance.patterns` and plug-in detectors (a kind
    not named keeps its built-in default; one without any: flag)."""

    IN_SUPERVISOR_CONFIG = False

    prompts: dict[str, SensitiveAction] = Field(
        default_factory=lambda: dict(DEFAULT_PROMPTS),
        description="In prompts: block (refuse the request), redact (before the engine sees it), flag (mark "
        "the audit record) or allow.")
    answers: dict[str, SensitiveAction] = Field(
        default_factory=lambda: dict(DEFAULT_ANSWERS),
        description="In answers: redact (before the client sees it, streamed answers included), flag or allow "
        "(an answer cannot be refused once it streams).")

    @field_validator("answers")
    @classmethod
    def _answers_not_blocked(cls, value: dict[str, SensitiveAction]) -> dict[str, SensitiveAction]:
        if blocked := sorted(kind for kind, action in value.items() if action == "block"):
            raise ValueError(f"{blocked}: an answer cannot be blocked (it may be streaming already); use redact")
        return value


class RolePolicy(CompliancePolicy):
    """A role's own actions, for the kinds it names (the rest: the default policy's)."""

    prompts: dict[str, SensitiveAction] = Field(default_factory=dict)
    answers: dict[str, SensitiveAction] = Field(default_factory=dict)


class ComplianceSettings(_Section):
    """Sensitive data, wherever it is screened: the one scanner's kinds (built in, `patterns`,
    plug-in `detectors`) and what each use does with a finding. The gateway screens every prompt
    before the engine sees it and every answer before the client does, as the caller's roles'
    policy says (`default`, `roles`: a user holding several roles gets, kind by kind, the most
    generous of their policies); dataset ingestion (`appliance data add`) and RL export screen
    every training row (`training_data`)."""

    IN_SUPERVISOR_CONFIG = False

    patterns: dict[str, str] = Field(
        default_factory=dict, description="Further kinds to find in prompts, answers and training data: name = "
        "regular expression (Python `regex`).")
    detectors: list[str] = Field(
        default_factory=lambda: ["national_ids"],
        description="Plug-in detectors to use in prompts, answers and training data: names of `appliance.detectors` "
        "entry points (national_ids: US social security and UK national insurance numbers).")
    training_data: Literal["block", "redact", "allow"] = Field(
        "block", description="What dataset ingestion (`appliance data add`) and RL export do with any kind found "
        "in a training row: refuse the whole set, replace each finding by its kind, or keep it (always reported).")
    default: CompliancePolicy = Field(default_factory=CompliancePolicy,
                                      description="The gateway's policy for every role without one of its own.")
    roles: dict[str, RolePolicy] = Field(default_factory=dict,
                                         description="The gateway's policies of roles, by role name.")
    hold_chars: int = Field(
        256, ge=80, le=65536, description="Of a streamed answer, how much text may be held back while it could "
        "still be part of a finding to redact.")

    @field_validator("patterns")
    @classmethod
    def _patterns_compile(cls, value: dict[str, str]) -> dict[str, str]:
        import regex

        for kind, pattern in value.items():
            if not re.fullmatch(r"[a-z][a-z0-9_]{0,39}", kind):
                raise ValueError(f"{kind!r}: a kind is lower-case letters, digits and '_' (up to 40)")
            try:
                regex.compile(pattern)
            except regex.error as exc:
                raise ValueError(f"{kind}: not a regular expression ({exc})") from None
        return value


class Settings(_Section):
    """All settings, composed from one section per concern."""

    engine: EngineSettings = Field(default_factory=EngineSettings)
    keycloak: KeycloakSettings = Field(default_factory=KeycloakSettings)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    audit: AuditSettings = Field(default_factory=AuditSettings)
    artifacts: ArtifactSettings = Field(default_factory=ArtifactSettings)
    finetune: FinetuneSettings = Field(default_factory=FinetuneSettings)
    execution: ExecutionSettings = Field(default_factory=ExecutionSettings)
    rl: RlSettings = Field(default_factory=RlSettings)
    cluster: ClusterSettings = Field(default_factory=ClusterSettings)
    compliance: ComplianceSettings = Field(default_factory=ComplianceSettings)
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    batch: BatchSettings = Field(default_factory=BatchSettings)
    backup: BackupSettings = Field(default_factory=BackupSettings)
    monitoring: MonitoringSettings = Field(default_factory=MonitoringSettings)
    watchdog: WatchdogSettings = Field(default_factory=WatchdogSettings)
    pools: list[PoolSettings] = Field(
        default_factory=lambda: [PoolSettings(name="main")],
        min_length=1,
        description="vLLM pools; each is one supervised vllm-<name> program per replica.",
    )

    @model_validator(mode="after")
    def _keycloak_frontend(self) -> Settings:
        """The embedded Keycloak is published through the gateway at its public URL, if it has one."""
        self.keycloak._frontend = self.gateway.public_url if self.keycloak.mode == "embedded" else None
        return self

    @model_validator(mode="after")
    def _pools_distinct(self) -> Settings:
        seen: set[str] = set()
        for pool in self.pools:
            if pool.name in seen:
                raise ValueError(f"two pools share name {pool.name!r}; give each its own")
            seen.add(pool.name)
        return self

    def masked(self) -> dict[str, Any]:
        """The settings as JSON data with secrets replaced by a mask (for display and digests)."""
        data = self.model_dump(mode="json")
        for section, field in SECRET_FIELDS:
            if data[section].get(field):
                data[section][field] = MASK
        return data

    def digest(self) -> str:
        """A short SHA-256 of the masked settings: which configuration a start used."""
        text = json.dumps(self.masked(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def pool(self, name: str) -> PoolSettings:
        """The pool called `name`."""
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise SettingsError(f"no pool named {name!r}", hint=f"pools: {[p.name for p in self.pools]}")


# Settings that moved, old name -> new: a file or variable still naming the old one is refused with
# the new name (left unread, it would leave the operator's policy silently unapplied).
MOVED = {("finetune", "sensitive_data"): "compliance.training_data",
         ("finetune", "sensitive_patterns"): "compliance.patterns"}


def load_settings(path: Path, environ: Mapping[str, str] | None = None) -> Settings:
    """Read `path` (missing means all defaults), apply APPLIANCE_* overrides, validate."""
    environ = os.environ if environ is None else environ
    text = ""
    data: dict[str, Any] = {}
    if path.exists():
        text = path.read_text()
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"{path}: not valid TOML: {exc}") from exc
    overrides = _apply_env(data, environ)
    _refuse_moved(path, text, data, overrides)
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = _dotted(error["loc"], data)
        # A section's own rule (fields that must agree) names the variables that set any of them.
        within = [variable for name, variable in overrides.items() if name.startswith(f"{field}.")]
        source = overrides.get(field) or ", ".join(within) or _locate(path, text, error["loc"], data)
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise SettingsError(f"{source}: {field or 'settings'}: {error['msg']}{more}") from exc


def _refuse_moved(path: Path, text: str, data: dict[str, Any], overrides: dict[str, str]) -> None:
    """SettingsError naming the source and the new name of the first setting in MOVED that is set."""
    for (section, key), new in MOVED.items():
        table = data.get(section)
        if isinstance(table, dict) and key in table:
            old = f"{section}.{key}"
            source = overrides.get(old) or _locate(path, text, (section, key), data)
            raise SettingsError(f"{source}: {old} is no longer a setting: it moved to {new}",
                                hint=f"rename it {new} (see `appliance settings defaults`)")


def _apply_env(data: dict[str, Any], environ: Mapping[str, str]) -> dict[str, str]:
    """Fold APPLIANCE_SECTION__FIELD (or APPLIANCE_POOLS__<NAME>__FIELD) into `data`.

    Returns {dotted field: variable name} so errors can point at the variable.
    """
    applied: dict[str, str] = {}
    for var in sorted(environ):
        if not var.startswith(ENV_PREFIX) or var in _ENV_NOT_SETTINGS:
            continue
        path = [part.lower() for part in var[len(ENV_PREFIX):].split("__")]
        value = _parse_env_value(environ[var])
        if path[0] == "pools":
            if len(path) != 3:
                raise SettingsError(f"{var}: pool overrides look like APPLIANCE_POOLS__<NAME>__<FIELD>")
            pools = data.setdefault("pools", [{"name": "main"}])
            pool = next((p for p in pools if isinstance(p, dict) and p.get("name") == path[1]), None)
            if pool is None:
                raise SettingsError(f"{var}: no pool named {path[1]!r} in the settings file")
            pool[path[2]] = value
            applied[f"pools.{path[1]}.{path[2]}"] = var
            continue
        if len(path) != 2 or path[0] not in Settings.model_fields:
            raise SettingsError(
                f"{var}: unknown setting", hint="overrides look like APPLIANCE_<SECTION>__<FIELD>"
            )
        section = data.setdefault(path[0], {})
        section[path[1]] = value
        applied[".".join(path)] = var
    return applied


def _parse_env_value(raw: str) -> Any:
    """A TOML value if it parses as one (numbers, booleans, arrays), else the raw string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _dotted(loc: tuple[int | str, ...], data: dict[str, Any]) -> str:
    """('pools', 0, 'port') -> 'pools.main.port' (pools are named by name, not index)."""
    parts: list[str] = []
    for i, part in enumerate(loc):
        if isinstance(part, int) and loc[:i] == ("pools",):
            pools = data.get("pools") or []
            name = pools[part].get("name") if part < len(pools) and isinstance(pools[part], dict) else None
            parts.append(str(name) if name else str(part))
        else:
            parts.append(str(part))
    return ".".join(parts)


def _locate(path: Path, text: str, loc: tuple[int | str, ...], data: dict[str, Any]) -> str:
    """'FILE:LINE' of the key the error is about, or 'FILE' (or 'defaults') if it has no line."""
    if not text:
        return "defaults" if not path.exists() else str(path)
    table = [str(p) for p in loc[:-1] if not isinstance(p, int)]
    key = str(loc[-1]) if loc and not isinstance(loc[-1], int) else None
    index = next((p for p in loc if isinstance(p, int)), None)
    current: list[str] = []
    array_seen = -1
    for number, line in enumerate(text.splitlines(), start=1):
        header = re.match(r"^\s*(\[\[?)\s*([\w.-]+)\s*\]\]?", line)
        if header:
            current = header.group(2).split(".")
            if key and header.group(1) == "[" and current == [*table, key]:
                return f"{path}:{number}"  # the error is about the whole section
            if header.group(1) == "[[" and current == table:
                array_seen += 1
            continue
        if key and current == table and (index is None or index == array_seen):
            if re.match(rf"^\s*{re.escape(key)}\s*=", line):
                return f"{path}:{number}"
    return str(path)


def render_defaults() -> str:
    """A commented settings.toml holding every default: the settings' documentation."""
    lines = ["# Appliance settings. Every key is optional; shown with its default.",
             "# Environment overrides: APPLIANCE_<SECTION>__<FIELD>, APPLIANCE_POOLS__<NAME>__<FIELD>.", ""]
    defaults = Settings()
    for section in Settings.model_fields:  # every section, so none is left undocumented
        if section == "pools":
            continue
        lines.append(f"[{section}]")
        lines += _render_fields(getattr(defaults, section), section)
        lines.append("")
    for pool in defaults.pools:
        lines.append("[[pools]]")
        lines += _render_fields(pool, "pools")
    return "\n".join(lines) + "\n"


def _render_fields(model: BaseModel, table: str) -> list[str]:
    """Each field of `model`, the TOML table `table`, under its description. A field holding a
    table comes last, as `[table.field]`: a key after it would belong to it."""
    data = model.model_dump(mode="json")
    keys: list[str] = []
    tables: list[str] = []
    for name, info in type(model).model_fields.items():
        value = _without_nulls(data[name])
        if value is None:
            keys += [f"# {info.description}", f"# {name} = (unset)"]
        elif isinstance(value, dict):
            tables += [f"# {info.description}", tomli_w.dumps({table: {name: value}}).rstrip("\n")]
        else:
            keys += [f"# {info.description}", tomli_w.dumps({name: value}).rstrip("\n")]
    return keys + tables


def _without_nulls(value: Any) -> Any:
    """JSON data with None left out of its tables: TOML has no null, and an unset field takes its
    default."""
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value
