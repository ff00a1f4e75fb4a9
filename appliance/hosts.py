"""Hosts of a cluster, on the head: who may join (a one-time join token), who has joined (a
credential each worker presents), and the records the head and its workers exchange.

`appliance hosts add NAME` invites a host and prints its join token once; `appliance join` on
that host redeems it over TLS pinned to the head's CA (the token carries the CA's fingerprint, so
the worker trusts no one else), receives a credential and its ranks' launch, and then reports its
ranks' state in heartbeats. The head keeps only SHA-256 digests of tokens and credentials.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from contextlib import AbstractContextManager
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, IPvAnyAddress, ValidationError

from appliance.digest import sha256_file
from appliance.durable import read_small_file
from appliance.errors import ApplianceError, Conflict, Invalid, NotFound, StateError
from appliance.home import Home
from appliance.records import HostName
from appliance.registry import JsonRegistry

TOKEN_PREFIX = "ajt1"
Digest = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
# No segment starts with a dot: no `.`, `..` or hidden file.
RelativePath = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*(/[A-Za-z0-9_-][A-Za-z0-9_.-]*)*$",
                                    max_length=512)]
PoolName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9-]{0,30}$")]


class Refused(ApplianceError):
    """A join token or credential that is wrong, used, expired or revoked (401)."""

    code = "unauthorized"


class HostState(StrEnum):
    INVITED = "invited"
    JOINED = "joined"
    REFUSED = "refused"  # joined, but what it reported (its weights) failed verification


class HostRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: HostName
    state: HostState
    invited_at: datetime
    token_sha256: Digest | None = None
    token_expires: datetime | None = None
    credential_sha256: Digest | None = None
    address: str | None = None
    joined_at: datetime | None = None
    problem: str | None = Field(None, description="Why it was refused (the file that failed verification).")


class HostRegistry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hosts: dict[str, HostRecord] = Field(default_factory=dict)


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def registry_path(home: Home) -> Path:
    return home.root / "hosts.json"


def _registry(home: Home) -> JsonRegistry[HostRegistry]:
    return JsonRegistry(registry_path(home), HostRegistry, "the host registry")


def load(home: Home) -> HostRegistry:
    return _registry(home).read()


def updating(home: Home) -> AbstractContextManager[HostRegistry]:
    """The registry to change in the block; written back (atomically) only if the block succeeds."""
    return _registry(home).change()


def invite(home: Home, name: str, ttl_s: int, ca_sha256: str, now: datetime | None = None) -> str:
    """Invite `name` (or invite it again, if it has not joined); the join token, shown only here."""
    now = now or datetime.now(UTC)
    secret = secrets.token_urlsafe(32)
    with updating(home) as registry:
        existing = registry.hosts.get(name)
        if existing is not None and existing.state != HostState.INVITED:
            raise Conflict(f"host {name} has joined already", hint=f"remove it first: appliance hosts remove {name}")
        registry.hosts[name] = HostRecord(name=name, state=HostState.INVITED, invited_at=now,
                                          token_sha256=_digest(secret), token_expires=now + timedelta(seconds=ttl_s))
    return join_token(name, secret, ca_sha256)


def join_token(name: str, secret: str, ca_sha256: str) -> str:
    """What the operator carries to the worker: its name, the secret and the head CA's fingerprint."""
    encoded = base64.urlsafe_b64encode(name.encode()).decode().rstrip("=")
    return f"{TOKEN_PREFIX}.{encoded}.{secret}.{ca_sha256}"


class JoinToken(BaseModel):
    name: HostName
    secret: str
    ca_sha256: Digest


def parse_join_token(token: str) -> JoinToken:
    parts = token.strip().split(".")
    if len(parts) != 4 or parts[0] != TOKEN_PREFIX:
        raise Invalid("not a join token (expected ajt1.NAME.SECRET.CA, as `appliance hosts add` prints it)")
    try:
        name = base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)).decode()
        return JoinToken(name=name, secret=parts[2], ca_sha256=parts[3])
    except (ValueError, ValidationError) as exc:
        raise Invalid("not a join token: its name or CA fingerprint is malformed") from exc


def _check_token(registry: HostRegistry, name: str, secret: str, now: datetime) -> HostRecord:
    host = registry.hosts.get(name)
    if host is None:
        raise Refused(f"host {name} is not invited")
    if host.token_sha256 is None:
        raise Refused(f"host {name}: its join token was used already")
    if not hmac.compare_digest(host.token_sha256, _digest(secret)):
        raise Refused(f"host {name}: wrong join token")
    if host.token_expires is None or host.token_expires < now:
        raise Refused(f"host {name}: its join token expired", hint=f"invite it again: appliance hosts add {name}")
    return host


def check_token(home: Home, name: str, secret: str, now: datetime | None = None) -> None:
    """Refused (naming why, never the secret) unless `secret` is `name`'s unused, unexpired token."""
    _check_token(load(home), name, secret, now or datetime.now(UTC))


def redeem(home: Home, name: str, secret: str, address: str, now: datetime | None = None) -> str:
    """Join `name` with its one-time token; its new credential. Refused as `check_token` says."""
    now = now or datetime.now(UTC)
    credential = secrets.token_urlsafe(32)
    with updating(home) as registry:
        host = _check_token(registry, name, secret, now)
        registry.hosts[name] = host.model_copy(update={
            "state": HostState.JOINED, "token_sha256": None, "token_expires": None, "joined_at": now,
            "credential_sha256": _digest(credential), "address": address, "problem": None})
    return credential


def authenticate(home: Home, name: str, credential: str) -> HostRecord:
    """The joined host presenting `credential`; Refused otherwise."""
    host = load(home).hosts.get(name)
    if host is None or host.credential_sha256 is None or not hmac.compare_digest(
            host.credential_sha256, _digest(credential)):
        raise Refused(f"host {name}: unknown or revoked credential")
    if host.state != HostState.JOINED:
        raise Refused(f"host {name}: refused ({host.problem})", hint=f"appliance hosts remove {name}, add it again")
    return host


def refuse(home: Home, name: str, problem: str) -> None:
    """Mark a joined host refused: what it reported failed verification."""
    with updating(home) as registry:
        host = registry.hosts.get(name)
        if host is None:
            raise NotFound(f"host {name} is not registered")
        registry.hosts[name] = host.model_copy(update={"state": HostState.REFUSED, "problem": problem})


def remove(home: Home, name: str) -> None:
    """Forget a host: its token and credential stop working at once."""
    with updating(home) as registry:
        if registry.hosts.pop(name, None) is None:
            raise NotFound(f"host {name} is not registered", hint="appliance hosts list")


# --- what the head and a worker exchange --------------------------------------------------------


class JoinRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: HostName
    secret: str = Field(pattern=r"^[A-Za-z0-9_-]{1,256}$")
    home: str = Field(max_length=4096, pattern=r"^/[^\n\x00]*$", description="The worker's state dir.")
    python: str = Field(max_length=4096, pattern=r"^/[^\n\x00]*$", description="The worker's interpreter.")
    engine: str = Field(pattern=r"^(cpu|cuda)$", description="The vLLM build the worker runs.")
    address: IPvAnyAddress = Field(description="The worker's address on the cluster network.")
    interface: str | None = Field(None, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")


class WeightFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    path: RelativePath
    bytes: int = Field(ge=0)
    sha256: Digest


# A file's digest, by its path, size and modification time: unchanged files are not read again.
Digests = dict[tuple[str, int, int], str]


def weight_files(directory: Path, known: Digests | None = None) -> list[WeightFile]:
    """Every regular file under `directory` (no links, nothing hidden) with its size and SHA-256;
    `known` keeps digests by (path, size, mtime) so that unchanged files are not read again."""
    files = []
    for path in sorted(directory.rglob("*")):
        relative = path.relative_to(directory).as_posix()
        if path.is_symlink() or not path.is_file() or any(part.startswith(".") for part in relative.split("/")):
            continue
        stat = path.stat()
        key = (relative, stat.st_size, stat.st_mtime_ns)
        digest = known.get(key) if known is not None else None
        if digest is None:
            digest = sha256_file(path)
            if known is not None:
                known[key] = digest
        files.append(WeightFile(path=relative, bytes=stat.st_size, sha256=digest))
    if not files:
        raise Invalid(f"{directory} holds no weights a worker can take (links are not followed: copy a "
                      "checkpoint made of links, such as a Hugging Face cache snapshot, into a directory first)")
    return files


def worker_model_dir(home: str, pool: str) -> str:
    """Where a worker keeps the weights of `pool` (the head writes it into the ranks' argv)."""
    return f"{home.rstrip('/')}/models/cluster-{pool}"


class RankLaunch(BaseModel):
    """One pool's ranks on the worker: vLLM's argv and environment from the head's launcher, and
    the weights they load from `worker_model_dir`."""

    model_config = ConfigDict(extra="forbid")

    pool: PoolName
    node: int = Field(ge=1)
    argv: list[str] = Field(max_length=256)
    env: dict[str, str]
    files: list[WeightFile] = Field(min_length=1)


class Membership(BaseModel):
    """What a joined worker keeps (its credential apart, in secrets/): its head and its ranks."""

    model_config = ConfigDict(extra="forbid")

    head_url: str
    name: HostName
    heartbeat_s: float
    ranks: list[RankLaunch]


def membership_file(home: Home) -> Path:
    return home.root / "membership.json"


def membership(home: Home) -> Membership | None:
    """This host's membership of a cluster, if it joined one as a worker."""
    path = membership_file(home)
    if not path.exists():
        return None
    try:
        return Membership.model_validate_json(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise StateError(f"{path} is unreadable: {exc}", hint="join again (appliance join)") from exc


class JoinAnswer(BaseModel):
    model_config = ConfigDict(extra="forbid")

    credential: str
    heartbeat_s: float
    ranks: list[RankLaunch]


class RankReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pool: PoolName
    epoch: int = Field(ge=0, description="The epoch the rank was (re)started for.")
    running: bool
    pid: int = Field(ge=0)


class Heartbeat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ranks: list[RankReport] = Field(max_length=64)


class HeartbeatAnswer(BaseModel):
    model_config = ConfigDict(extra="forbid")

    epochs: dict[str, int] = Field(description="Each pool's current epoch: a rank of an older one restarts.")


class WeightsReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pool: PoolName
    problem: str | None = Field(None, max_length=4096, description="None: every file verified.")


# --- the head's view of a pool spanning hosts (written by its controller, read by the gateway and status)


class RankView(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str
    node: int
    running: bool
    pid: int
    epoch: int
    seen_s_ago: float | None = Field(None, description="Since its last heartbeat (workers); None: never.")


class ClusterPoolState(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pool: str
    epoch: int
    ready: bool
    why: str = Field(description="Why it is not ready, or 'serving'.")
    ranks: list[RankView]


def cluster_state_file(home: Home, pool: str) -> Path:
    return home.run / "cluster" / f"{pool}.json"


MAX_CLUSTER_STATE_BYTES = 1 << 20


def read_cluster_state(path: Path) -> ClusterPoolState | None:
    """The controller's last word on a pool (`cluster_state_file`); None if it wrote none (or it
    cannot be read)."""
    found = cluster_state_written(path)
    return None if found is None else found[0]


def cluster_state_written(path: Path) -> tuple[ClusterPoolState, float] | None:
    """The controller's last word on a pool and when it wrote it (Unix time); None unless a plain,
    whole file of at most MAX_CLUSTER_STATE_BYTES (never a link followed, nor a pipe waited on)."""
    found = read_small_file(path, MAX_CLUSTER_STATE_BYTES)
    if found is None:
        return None
    try:
        return ClusterPoolState.model_validate_json(found[0]), found[1]
    except ValueError:
        return None
