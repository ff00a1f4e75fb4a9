"""API keys at the gateway: the principal of a bearer credential that is an API key.

The key's record (appliance.api_keys) is looked up by its keyed hash in the registry, read again
whenever the file changes (a revocation counts from the next request). The key then acts as its
owner with the roles Keycloak gives them now: the owner's record is fetched with the gateway's
service account and kept for the introspection interval, so a disabled owner's keys stop within
it, as their tokens do. If Keycloak cannot be asked the request is refused (503), never let through.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import anyio

from appliance import api_keys
from appliance.api_keys import KeyState
from appliance.errors import ApplianceError, NotFound
from appliance.home import Home
from appliance.users import User
from serve.auth import Principal
from serve.errors import AuthError

OWNER_CACHE_MAX = 10_000
WARM_OWNERS_MAX = 100  # owners looked up ahead at a start; the rest on their first request


@dataclass(frozen=True)
class _Owner:
    subject: str | None  # None: no such user (remembered too, so a key of a deleted user costs no lookup)
    user: User | None
    fetched: float


def usable(key: api_keys.ApiKey, now: datetime) -> None:
    """AuthError unless `key` is active now (api_keys.ApiKey.state decides; this only says why not)."""
    state = key.state(now)
    if state is KeyState.REVOKED:
        raise AuthError("revoked_key", f"API key {key.name!r} was revoked")
    if state is KeyState.EXPIRED:
        raise AuthError("expired_key", f"API key {key.name!r} expired at {key.expires:%Y-%m-%dT%H:%M:%SZ}")


def owner_state(key: api_keys.ApiKey, owner: _Owner) -> KeyState:
    """ACTIVE, or why the key's owner stops it: gone (no such user, or another made since under
    the name: a key is bound to its owner's id), or disabled."""
    if owner.user is None or owner.subject is None or owner.subject != key.owner_id:
        return KeyState.OWNER_GONE
    return KeyState.ACTIVE if owner.user.enabled else KeyState.OWNER_DISABLED


class KeyAuthenticator:
    """Principals for API keys; `lookup_owner` is the realm's user lookup (blocking: run in a thread)."""

    def __init__(self, home: Home, lookup_owner: Callable[[str], tuple[str, User]], owner_ttl_s: float) -> None:
        self.home = home
        self._lookup_owner = lookup_owner
        self._owner_ttl = owner_ttl_s
        self._registry = api_keys.registry(home)
        self._hmac_key = api_keys.hmac_secret(home)  # read once: not a file read a request
        self._seen: tuple[int, int, int] | None = None  # the registry file's (inode, size, mtime) when read
        self._by_digest: dict[str, api_keys.ApiKey] = {}
        self._owners: dict[str, _Owner] = {}
        self._used: dict[str, float] = {}  # key (api_keys.ref) -> when its last use was written

    async def principal(self, bearer: str, known: Callable[[api_keys.ApiKey], None] = lambda key: None) -> Principal:
        """The principal an API key acts as, else AuthError saying why; `known` is told the key
        once it is found, so that a refusal's record can name it and its owner."""
        if not api_keys.well_formed(bearer):
            raise AuthError("malformed", "not a well-formed API key (apk- and 43 characters)")
        key = self._key(api_keys.digest(self._hmac_key, bearer))
        if key is None:
            raise AuthError("invalid_key", "API key is not valid")
        known(key)
        now = datetime.now(UTC)
        usable(key, now)
        owner = await self._owner(key.owner)
        standing = owner_state(key, owner)
        if standing is not KeyState.ACTIVE or owner.user is None or owner.subject is None:
            what = "is disabled" if standing is KeyState.OWNER_DISABLED else "no longer exists"
            raise AuthError("inactive", f"the owner of API key {key.name!r} {what}")
        await self._note_use(api_keys.ref(key.owner, key.name), now)
        return Principal.for_key(key, subject=owner.subject,
                                 roles=frozenset(role.value for role in owner.user.roles))

    async def standing(self, key: api_keys.ApiKey, now: datetime) -> KeyState:
        """What `principal` would do with `key` now, as a state: its own (revoked, expired), else
        its owner's as the cache holds it (looked up where stale); OWNER_UNCONFIRMED where
        Keycloak cannot be asked (a request with it is refused with 503 meanwhile)."""
        state = key.state(now)
        if state is not KeyState.ACTIVE:
            return state
        try:
            owner = await self._owner(key.owner)
        except AuthError:
            return KeyState.OWNER_UNCONFIRMED
        return owner_state(key, owner)

    async def warm(self, retry_s: float = 1.0, give_up_s: float = 300.0) -> None:
        """Look the owners of the usable keys up as soon as Keycloak answers, so that the first
        requests after a start do not wait on it. The entries expire like any other; a lookup that
        fails is tried again every `retry_s` for `give_up_s` (Keycloak may start after the gateway)."""
        started = time.monotonic()
        try:
            now = datetime.now(UTC)
            owners = sorted({key.owner for key in self._keys().values() if key.state(now) is KeyState.ACTIVE})
        except AuthError:
            return  # an unreadable registry: each request says so
        for owner in owners[:WARM_OWNERS_MAX]:
            while True:
                try:
                    await self._owner(owner)
                    break
                except AuthError:
                    if time.monotonic() - started > give_up_s:
                        return
                    await anyio.sleep(retry_s)

    async def roles_now(self, username: str, subject: str) -> frozenset[str]:
        """The realm roles `username` holds now, looked up as a key's owner is (a batch checks its
        owner before each request); AuthError (403) when they are no longer the user `subject`, or
        are disabled, and (503) when Keycloak cannot be asked."""
        owner = await self._owner(username)
        if owner.user is None or owner.subject != subject:
            raise AuthError("inactive", f"user {username!r} no longer exists", status=403)
        if not owner.user.enabled:
            raise AuthError("inactive", f"user {username!r} is disabled", status=403)
        return frozenset(role.value for role in owner.user.roles)

    def named(self, owner: str, name: str) -> api_keys.ApiKey:
        """`owner`'s usable key called `name` (a batch made with it: its requests stop when the key does)."""
        key = next((key for key in self._keys().values() if (key.owner, key.name) == (owner, name)), None)
        if key is None:
            raise AuthError("revoked_key", f"API key {name!r} no longer exists")
        usable(key, datetime.now(UTC))
        return key

    def _key(self, digest: str) -> api_keys.ApiKey | None:
        return self._keys().get(digest)

    def _keys(self) -> dict[str, api_keys.ApiKey]:
        """The registry by keyed hash, read again whenever its file changed."""
        try:
            found = os.stat(self._registry.path)
            seen = (found.st_ino, found.st_size, found.st_mtime_ns)
        except FileNotFoundError:
            seen = None
        if seen != self._seen or seen is None:
            try:
                keys = self._registry.read()
            except ApplianceError as exc:
                raise AuthError("keys_unavailable", "API keys cannot be checked now; try again", status=503) from exc
            self._by_digest = {key.digest: key for key in keys.values()}
            self._seen = seen
        return self._by_digest

    async def _owner(self, username: str) -> _Owner:
        cached = self._owners.get(username)
        if cached is not None and time.monotonic() - cached.fetched <= self._owner_ttl:
            return cached
        subject: str | None
        user: User | None
        try:
            subject, user = await anyio.to_thread.run_sync(self._lookup_owner, username)
        except NotFound:
            subject, user = None, None
        except ApplianceError as exc:  # Keycloak down or refusing: fail closed
            raise AuthError("introspection_unavailable", "cannot confirm the API key's owner; try again",
                            status=503) from exc
        if len(self._owners) >= OWNER_CACHE_MAX:
            self._owners.clear()
        self._owners[username] = found = _Owner(subject, user, time.monotonic())
        return found

    async def _note_use(self, index: str, now: datetime) -> None:
        """Write when the key was used, at most once a USE_WRITE_INTERVAL_S a key (a failed write
        is tried again on the next use: last use is for display, never for a decision)."""
        if time.monotonic() - self._used.get(index, float("-inf")) < api_keys.USE_WRITE_INTERVAL_S:
            return
        self._used[index] = time.monotonic()
        await anyio.to_thread.run_sync(self._write_use, index, now)

    def _write_use(self, index: str, now: datetime) -> None:
        try:
            with api_keys.uses(self.home).change() as uses:
                uses[index] = now.replace(second=0, microsecond=0)
        except (ApplianceError, OSError):
            self._used.pop(index, None)
