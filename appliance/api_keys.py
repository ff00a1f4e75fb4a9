"""API keys for applications: a long-lived bearer credential that acts as one realm user.

A key is `apk-` followed by 256 random bits (base64url, 43 characters); it is shown once, when it
is made. The registry keeps only its HMAC-SHA256 under a secret of this host (`api-key-hmac`), so
a copy of the registry (a backup, a support bundle) cannot be used to call the gateway, and a
lookup needs no scan: the keyed hash is the index. Each key has a name, its owner, an optional
expiry, optional models it is limited to and an optional token budget a minute on top of its
owner's; those limits may change while it is active (`limit`). Names are scoped per owner: two
users may each have a key named `ci`, a key is found by its owner and name together (`ref`, the
registry's and the use record's index), and nobody learns another user's key names by trying to
make one. A revoked key stays in the registry (its name is not reused by its owner, its audit
records keep meaning something).

A registry written when names were unique on the appliance is indexed by name alone; it is read as
it is, and the first change re-indexes it (and the use record with it) by owner and name.

The gateway reads the registry again whenever the file changes, so a revocation takes effect on
the next request. When a key was last used is kept apart (`api-key-use.json`), written at most
once a minute a key, so a busy key does not rewrite the registry on every request.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets as token_source
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from appliance import durations
from appliance.errors import Conflict, Invalid, NotFound, QuotaExceeded
from appliance.home import Home
from appliance.registry import JsonRegistry
from appliance.secrets import secret

PREFIX = "apk-"
KEY_BYTES = 32
HMAC_SECRET = "api-key-hmac"
USE_WRITE_INTERVAL_S = 60.0
KeyName = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$")]
ModelName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")]
MAX_MODELS = 16
MAX_TOKENS_PER_MINUTE = 1_000_000_000
# A key's limits as a caller gives them, when it is made and when they change: one rule for both.
Models = Annotated[list[ModelName], Field(min_length=1, max_length=MAX_MODELS)]
TokensPerMinute = Annotated[StrictInt, Field(gt=0, le=MAX_TOKENS_PER_MINUTE)]  # `true` is no number
MAX_KEYS_PER_OWNER = 100  # revoked and expired ones included: they stay in the registry
MAX_KEYS = 5000
MAX_LIFETIME = timedelta(days=3653)  # ten years
_KEY_SHAPE = re.compile(rf"^{PREFIX}[A-Za-z0-9_-]{{43}}$")


class KeyState(StrEnum):
    """Where a key stands: the one rule the gateway, the admin API and `keys remove` all ask.
    Revoked and expired are the key's own (ApiKey.state); the owner's states are the gateway's
    judgement of a key otherwise active (serve.api_keys.KeyAuthenticator.standing): it refuses
    the key of an owner disabled or gone, and cannot confirm one while Keycloak does not answer."""

    ACTIVE = "active"
    REVOKED = "revoked"
    EXPIRED = "expired"
    OWNER_DISABLED = "owner disabled"
    OWNER_GONE = "owner gone"
    OWNER_UNCONFIRMED = "owner unconfirmed"


class KeyDetails(BaseModel):
    """A key as its owner and administrators see it: all that the registry keeps but the keyed
    hash. A field added here is in the registry and in every view of a key (serve.routes.keys)."""

    model_config = ConfigDict(extra="forbid")

    name: KeyName
    owner: str = Field(description="The realm user the key acts as.")
    owner_id: str = Field(description="That user's id in Keycloak: a user made later under the same name is "
                          "another user, whom the key does not act as.")
    created: datetime
    created_by: str
    expires: datetime | None = None
    models: list[str] | None = Field(None, description="The models (pools, tiers, adapter aliases) it may use; "
                                     "unset: those its owner may use.")
    tokens_per_minute: int | None = Field(None, gt=0, description="Its own token budget, on top of its owner's.")
    prefix: str = Field(description="The key's first characters, to recognise it by.")
    revoked: datetime | None = None


class ApiKey(KeyDetails):
    """A key as the registry keeps it: everything but the key itself. Only what no view may show
    is declared here; every other field belongs in KeyDetails."""

    digest: str = Field(pattern=r"^[0-9a-f]{64}$", description="HMAC-SHA256 of the key under this host's secret.")

    def state(self, now: datetime) -> KeyState:
        """Revoked, else expired from its expiry on, else active."""
        if self.revoked is not None:
            return KeyState.REVOKED
        if self.expires is not None and now >= self.expires:
            return KeyState.EXPIRED
        return KeyState.ACTIVE


class NewKey(BaseModel):
    """What `keys create` asks for."""

    model_config = ConfigDict(extra="forbid")

    name: KeyName
    owner: str = Field(min_length=1, max_length=64)
    expires_in: str | None = Field(None, description="e.g. 12h, 30d, 52w (a whole number and s, m, h, d or w); "
                                                     "unset: until revoked.")
    models: Models | None = None
    tokens_per_minute: TokensPerMinute | None = None


class NewLimits(BaseModel):
    """What `keys limit` asks for: a key's limits to change. A field left out is kept; one given as
    null is cleared (models: every model its owner may use; tokens_per_minute: its owner's budget only)."""

    model_config = ConfigDict(extra="forbid")

    models: Models | None = None
    tokens_per_minute: TokensPerMinute | None = None

    @model_validator(mode="after")
    def _names_a_limit(self) -> NewLimits:
        if not self.model_fields_set:
            raise ValueError("no limit to change: give models, tokens_per_minute or both (null clears one)")
        return self


class CreatedKey(BaseModel):
    key: ApiKey
    secret: str = Field(description="The key itself: shown only here, never again.")


Registry = dict[str, ApiKey]  # by `ref` (by name alone in a registry not changed since names were per owner)


def registry(home: Home) -> JsonRegistry[Registry]:
    return JsonRegistry(home.root / "api-keys.json", Registry, "the API key registry")


def ref(owner: str, name: str) -> str:
    """A key's index: its owner and name (a name holds no '/', so the pair reads back one way)."""
    return f"{owner}/{name}"


def expiry(expires_in: str | None, now: datetime, *, name: str = "expires_in") -> datetime | None:
    """When a key made now for `expires_in` ("12h", "30d", "52w": appliance.durations) expires;
    Invalid naming `name` (the field, or the CLI's option) for anything else."""
    if expires_in is None:
        return None
    lifetime = durations.parse(expires_in, name=name)
    if not lifetime:
        raise Invalid(f"{name} {expires_in!r} is no lifetime: give one longer than zero", hint="leave it unset for "
                      "a key that lives until it is revoked")
    if lifetime > MAX_LIFETIME:
        raise Invalid(f"{name} {expires_in!r} is longer than ten years", hint="leave it unset for a key that "
                      "lives until it is revoked")
    return now + lifetime


def hmac_secret(home: Home) -> bytes:
    """This host's secret the keys are hashed under (made on first use, mode 0600)."""
    return secret(home, HMAC_SECRET).encode()


def digest(hmac_key: bytes, key: str) -> str:
    """The key's HMAC-SHA256 under `hmac_key` (`hmac_secret`)."""
    return hmac.new(hmac_key, key.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()


def looks_like_key(bearer: str) -> bool:
    """Whether a bearer credential is an API key (and not a Keycloak token)."""
    return bearer.startswith(PREFIX)


def well_formed(bearer: str) -> bool:
    return _KEY_SHAPE.fullmatch(bearer) is not None


def create(home: Home, new: NewKey, owner_id: str, created_by: str, now: datetime | None = None) -> CreatedKey:
    """Make a key for `new.owner`, whose id in Keycloak is `owner_id` (the caller looked them up)."""
    now = now or datetime.now(UTC)
    value = PREFIX + base64.urlsafe_b64encode(token_source.token_bytes(KEY_BYTES)).rstrip(b"=").decode()
    key = ApiKey(name=new.name, owner=new.owner, owner_id=owner_id, created=now, created_by=created_by,
                 expires=expiry(new.expires_in, now), models=new.models,
                 tokens_per_minute=new.tokens_per_minute,
                 prefix=value[:len(PREFIX) + 6], digest=digest(hmac_secret(home), value))
    with _changing(home) as keys:
        if ref(new.owner, new.name) in keys:
            raise Conflict(f"{new.owner} already has an API key named {new.name!r}", hint="choose another name; "
                           "a revoked key's name is not reused")
        if sum(1 for other in keys.values() if other.owner == new.owner) >= MAX_KEYS_PER_OWNER:
            raise QuotaExceeded(f"{new.owner} has {MAX_KEYS_PER_OWNER} API keys, revoked and expired ones included "
                                "(the most one user may have)", hint="an administrator removes revoked and expired "
                                "ones with `appliance keys remove NAME`")
        if len(keys) >= MAX_KEYS:
            raise QuotaExceeded(f"the appliance holds {MAX_KEYS} API keys (the most it keeps)")
        keys[ref(new.owner, new.name)] = key
    return CreatedKey(key=key, secret=value)


def listing(home: Home, owner: str | None = None) -> list[ApiKey]:
    """The keys, by owner and name; only `owner`'s when given."""
    return sorted((key for key in registry(home).read().values() if owner is None or key.owner == owner),
                  key=lambda key: (key.owner, key.name))


def owners_of(home: Home, name: str) -> list[str]:
    """Who has a key called `name` (for an administrator who named no owner)."""
    return sorted(key.owner for key in registry(home).read().values() if key.name == name)


def get(home: Home, owner: str, name: str) -> ApiKey:
    key = next((key for key in registry(home).read().values() if (key.owner, key.name) == (owner, name)), None)
    if key is None:
        raise NotFound(f"{owner} has no API key named {name!r}", hint="`appliance keys list` shows them")
    return key


def revoke(home: Home, owner: str, name: str, now: datetime | None = None) -> ApiKey:
    """Revoke `owner`'s key `name` (at once: the gateway rereads the registry when it changes);
    revoking a revoked key changes nothing."""
    with _changing(home) as keys:
        key = keys.get(ref(owner, name))
        if key is None:
            raise NotFound(f"{owner} has no API key named {name!r}", hint="`appliance keys list` shows them")
        if key.revoked is None:
            keys[ref(owner, name)] = key = key.model_copy(update={"revoked": now or datetime.now(UTC)})
    return key


def limit(home: Home, owner: str, name: str, limits: NewLimits, now: datetime | None = None) -> tuple[ApiKey, ApiKey]:
    """Change the limits `limits` names of `owner`'s active key `name` (at once: the gateway rereads
    the registry when it changes); the key before and after. A revoked or expired key is refused:
    it serves no request, and a limit changed on it would say otherwise."""
    with _changing(home) as keys:
        key = keys.get(ref(owner, name))
        if key is None:
            raise NotFound(f"{owner} has no API key named {name!r}", hint="`appliance keys list` shows them")
        state = key.state(now or datetime.now(UTC))
        if state is not KeyState.ACTIVE:
            raise Conflict(f"API key {name!r} of {owner} is {state}: its limits can no longer change",
                           hint="make a new key with the limits wanted (`appliance keys create`)")
        keys[ref(owner, name)] = changed = key.model_copy(update=limits.model_dump(include=limits.model_fields_set))
    return key, changed


def described_limits(before: KeyDetails, after: KeyDetails) -> str:
    """`models: old -> new; tokens_per_minute: old -> new`, as the audit record and the CLI say it."""
    def models(key: KeyDetails) -> str:
        return ", ".join(key.models) if key.models else "(its owner's)"

    def budget(key: KeyDetails) -> str:
        return str(key.tokens_per_minute) if key.tokens_per_minute else "(its owner's only)"

    return (f"models: {models(before)} -> {models(after)}; "
            f"tokens_per_minute: {budget(before)} -> {budget(after)}")


def remove(home: Home, owner: str, name: str, now: datetime | None = None) -> ApiKey:
    """Delete `owner`'s revoked or expired key `name` from the registry (they may then use the name
    again; its audit records keep naming it). An active key is refused: revoke it first."""
    with _changing(home) as keys:
        key = keys.get(ref(owner, name))
        if key is None:
            raise NotFound(f"{owner} has no API key named {name!r}", hint="`appliance keys list` shows them")
        if key.state(now or datetime.now(UTC)) is KeyState.ACTIVE:
            raise Conflict(f"API key {name!r} of {owner} is active",
                           hint=f"`appliance keys revoke {name} --user {owner}` first")
        del keys[ref(owner, name)]
    with uses(home).change() as used:
        used.pop(ref(owner, name), None)
    return key


def uses(home: Home) -> JsonRegistry[dict[str, datetime]]:
    """When each key was last used (to the minute), by `ref`, as the gateway writes it."""
    return JsonRegistry(home.root / "api-key-use.json", dict[str, datetime], "the API key use record")


def last_uses(home: Home) -> dict[str, datetime]:
    """When each key was last used, by `ref`, whichever way the registry and the record are indexed."""
    used = uses(home).read()
    legacy = {name: ref(key.owner, key.name) for name, key in registry(home).read().items() if "/" not in name}
    return {legacy.get(name, name): when for name, when in used.items()}


@contextmanager
def _changing(home: Home) -> Iterator[Registry]:
    """The registry to change, indexed by `ref` (one indexed by name alone is re-indexed, and the
    use record with it)."""
    with registry(home).change() as keys:
        legacy = {name: ref(key.owner, key.name) for name, key in keys.items() if name != ref(key.owner, key.name)}
        if legacy:
            for name, index in legacy.items():
                keys[index] = keys.pop(name)
            with uses(home).change() as used:
                for name, index in legacy.items():
                    if name in used:
                        used.setdefault(index, used.pop(name))
        yield keys
