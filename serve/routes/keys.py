"""/admin/keys: API keys (appliance.api_keys). A user manages their own keys, an administrator
anyone's (`owner`: whose key a name is); a key itself can reach no /admin route (serve.deps), so a
key cannot make keys. Names are scoped per owner: nothing here tells a user whether another user
has a key of some name. Plain functions where the owner's lookup in Keycloak blocks; the listing
asks the gateway's key authenticator (its owner cache) what it would do with each key."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

import anyio
from fastapi import APIRouter, Depends, Query, Request

from appliance import api_keys
from appliance.errors import Invalid
from appliance.home import Home
from appliance.roles import Role
from appliance.settings import Settings
from appliance.users import Users
from serve.audit_trail import REFRESHED, note_detail, note_target
from serve.auth import Principal
from serve.deps import requires
from serve.errors import AuthError

KeyHolder = Annotated[Principal, Depends(requires(Role.USER, Role.ADMIN))]


class KeyView(api_keys.KeyDetails):
    """A key as listings show it: every field the registry keeps but its hash (api_keys.KeyDetails
    declares them), its state now and when it was last used."""

    state: api_keys.KeyState
    last_used: datetime | None


class CreatedKeyView(KeyView):
    secret: str


def view(key: api_keys.ApiKey, used: datetime | None, state: api_keys.KeyState | None = None) -> KeyView:
    """`state`: the gateway's judgement with the owner's (KeyAuthenticator.standing); unset, the key's own."""
    return KeyView(**key.model_dump(include=set(api_keys.KeyDetails.model_fields)),
                   state=state or key.state(datetime.now(key.created.tzinfo)), last_used=used)


def _may_manage(who: Principal, owner: str) -> None:
    if owner != who.username and Role.ADMIN not in who.roles:
        raise AuthError("missing_role", "only an administrator manages another user's keys", status=403)


def _owner(home: Home, who: Principal, name: str, owner: str | None) -> str:
    """Whose key `name` is meant: `owner` if the caller may manage their keys; unnamed, the
    caller's own, or for an administrator the one user who has a key of that name."""
    if owner is not None:
        _may_manage(who, owner)
        return owner
    if Role.ADMIN not in who.roles:
        return who.username
    owners = api_keys.owners_of(home, name)
    if len(owners) > 1:
        raise Invalid(f"{len(owners)} users have an API key named {name!r}: {', '.join(owners)}",
                      hint="name its owner (`--user USER`, or owner=USER)")
    return owners[0] if owners else who.username


Owner = Annotated[str | None, Query(max_length=64, description="Whose key it is (an administrator's choice; "
                                    "unset: yours, or the one user's who has a key of that name).")]


async def _admitted(request: Request, who: KeyHolder) -> Principal:
    """The caller, charged one request of their rate limit: managing keys is a request like any
    other (on the event loop: the limiter is not shared with threads)."""
    request.app.state.gateway.limiter.admit(who.subject, who.roles).settle(0, 0)
    return who


Admitted = Annotated[Principal, Depends(_admitted)]


def router(settings: Settings, home: Home) -> APIRouter:
    routes = APIRouter(prefix="/admin", tags=["keys"])

    @routes.get("/keys", response_model=list[KeyView], name="keys.list", openapi_extra=REFRESHED)
    async def list_keys(request: Request, who: Admitted,
                        owner: str | None = Query(None, max_length=64, description="Only this user's keys (an "
                                                  "administrator sees everyone's).")) -> list[KeyView]:
        """API keys: your own, or (administrators) everyone's, each in the state the gateway would
        treat it as now (its owner disabled or gone included)."""
        if Role.ADMIN not in who.roles:
            owner = who.username
        used = await anyio.to_thread.run_sync(api_keys.last_uses, home)
        keys = await anyio.to_thread.run_sync(api_keys.listing, home, owner)
        gateway, now = request.app.state.gateway, datetime.now(UTC)
        return [view(key, used.get(api_keys.ref(key.owner, key.name)), await gateway.keys.standing(key, now))
                for key in keys]

    @routes.post("/keys", response_model=CreatedKeyView, status_code=201, name="keys.create")
    def create_key(request: Request, who: Admitted, new: api_keys.NewKey) -> CreatedKeyView:
        """Make a key acting as `owner` (yourself, unless you are an administrator); its secret is
        in this answer only."""
        note_target(request, "key", new.name)
        _may_manage(who, new.owner)
        owner_id, owner = Users(settings, home).lookup(new.owner)
        if not owner.enabled:
            raise Invalid(f"user {new.owner!r} is disabled: a key of theirs would not work",
                          hint=f"`appliance users enable {new.owner}` first")
        created = api_keys.create(home, new, owner_id=owner_id, created_by=who.username)
        return CreatedKeyView(**view(created.key, None).model_dump(), secret=created.secret)

    @routes.post("/keys/{key_name}/revoke", response_model=KeyView, name="keys.revoke")
    def revoke_key(who: Admitted, key_name: str, owner: Owner = None) -> KeyView:
        """Revoke a key: its next request is refused (401), and so are its batches' requests."""
        owner = _owner(home, who, key_name, owner)
        revoked = api_keys.revoke(home, owner, key_name)
        return view(revoked, api_keys.last_uses(home).get(api_keys.ref(owner, key_name)))

    @routes.patch("/keys/{key_name}", response_model=KeyView, name="keys.limit")
    def limit_key(request: Request, who: Admitted, key_name: str, limits: api_keys.NewLimits,
                  owner: Owner = None) -> KeyView:
        """Change an active key's limits: a field left out is kept, one given as null is cleared
        (every model its owner may use; its owner's token budget only). Its next request is held
        to them; the audit record says the old and the new."""
        owner = _owner(home, who, key_name, owner)
        before, after = api_keys.limit(home, owner, key_name, limits)
        note_detail(request, api_keys.described_limits(before, after))
        return view(after, api_keys.last_uses(home).get(api_keys.ref(owner, key_name)))

    @routes.delete("/keys/{key_name}", response_model=KeyView, name="keys.remove")
    def remove_key(who: Admitted, key_name: str, owner: Owner = None) -> KeyView:
        """Delete a revoked or expired key from the registry (administrators); its owner may use
        its name again."""
        if Role.ADMIN not in who.roles:
            raise AuthError("missing_role", "only an administrator removes keys", status=403)
        return view(api_keys.remove(home, _owner(home, who, key_name, owner), key_name), None)

    return routes
