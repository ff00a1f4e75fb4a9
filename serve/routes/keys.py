"""/admin/keys: API keys (appliance.api_keys). A user manages their own keys, an administrator
anyone's; a key itself can reach no /admin route (serve.deps), so a key cannot make keys. Plain
functions: the owner's lookup in Keycloak blocks."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel

from appliance import api_keys
from appliance.errors import Invalid, NotFound
from appliance.home import Home
from appliance.roles import Role
from appliance.settings import Settings
from appliance.users import Users
from serve.audit_trail import REFRESHED, note_target
from serve.auth import Principal
from serve.deps import requires
from serve.errors import AuthError

KeyHolder = Annotated[Principal, Depends(requires(Role.USER, Role.ADMIN))]


class KeyView(BaseModel):
    """A key as listings show it: never its hash."""

    name: str
    owner: str
    prefix: str
    state: str
    created: datetime
    created_by: str
    expires: datetime | None
    last_used: datetime | None
    models: list[str] | None
    tokens_per_minute: int | None


class CreatedKeyView(KeyView):
    secret: str


def view(key: api_keys.ApiKey, used: datetime | None) -> KeyView:
    return KeyView(name=key.name, owner=key.owner, prefix=key.prefix, state=key.state(datetime.now(key.created.tzinfo)),
                   created=key.created, created_by=key.created_by, expires=key.expires, last_used=used,
                   models=key.models, tokens_per_minute=key.tokens_per_minute)


def _may_manage(who: Principal, owner: str) -> None:
    if owner != who.username and Role.ADMIN not in who.roles:
        raise AuthError("missing_role", "only an administrator manages another user's keys", status=403)


def _own(home: Home, who: Principal, name: str) -> api_keys.ApiKey:
    """The key called `name` if the caller may manage it; another user's key is NotFound to a
    non-administrator, as a key that does not exist (its name tells them nothing)."""
    key = api_keys.get(home, name)
    if key.owner != who.username and Role.ADMIN not in who.roles:
        raise NotFound(f"no API key named {name!r}", hint="`appliance keys list` shows yours")
    return key


async def _admitted(request: Request, who: KeyHolder) -> Principal:
    """The caller, charged one request of their rate limit: managing keys is a request like any
    other (on the event loop: the limiter is not shared with threads)."""
    request.app.state.gateway.limiter.admit(who.subject, who.roles).settle(0, 0)
    return who


Admitted = Annotated[Principal, Depends(_admitted)]


def router(settings: Settings, home: Home) -> APIRouter:
    routes = APIRouter(prefix="/admin", tags=["keys"])

    @routes.get("/keys", response_model=list[KeyView], name="keys.list", openapi_extra=REFRESHED)
    def list_keys(who: Admitted,
                  owner: str | None = Query(None, max_length=64, description="Only this user's keys (an "
                                            "administrator sees everyone's).")) -> list[KeyView]:
        """API keys: your own, or (administrators) everyone's."""
        if Role.ADMIN not in who.roles:
            owner = who.username
        used = api_keys.uses(home).read()
        return [view(key, used.get(key.name)) for key in api_keys.listing(home, owner)]

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
    def revoke_key(who: Admitted, key_name: str) -> KeyView:
        """Revoke a key: its next request is refused (401), and so are its batches' requests."""
        _own(home, who, key_name)
        return view(api_keys.revoke(home, key_name), api_keys.uses(home).read().get(key_name))

    @routes.delete("/keys/{key_name}", response_model=KeyView, name="keys.remove")
    def remove_key(who: Admitted, key_name: str) -> KeyView:
        """Delete a revoked or expired key from the registry (administrators); its name may be
        used again."""
        if Role.ADMIN not in who.roles:
            raise AuthError("missing_role", "only an administrator removes keys", status=403)
        return view(api_keys.remove(home, key_name), None)

    return routes
