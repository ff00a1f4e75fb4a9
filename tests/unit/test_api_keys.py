"""API keys: made once and kept only as a keyed hash; the gateway's principal for a key (revoked,
expired, owner disabled or gone, Keycloak away: each refused, never let through); hostile keys."""

from __future__ import annotations

import asyncio
import functools
import os
from datetime import UTC, datetime, timedelta

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance import api_keys
from appliance.errors import Conflict, Invalid, NotFound, QuotaExceeded, Unavailable
from appliance.home import Home
from appliance.roles import Role
from appliance.settings import RoleLimits
from appliance.users import User
from serve.api_keys import KeyAuthenticator, usable
from serve.auth import Principal
from serve.errors import AuthError, GatewayError
from serve.limits import RateLimiter
from serve.routes.keys import KeyView, view


class Realm:
    """The realm's users as the gateway's lookup would find them; counts lookups."""

    def __init__(self) -> None:
        self.users = {"kate": User(username="kate", enabled=True, roles=[Role.USER])}
        self.lookups = 0
        self.down = False
        self.ids: dict[str, str] = {}  # a user's id, when not id-NAME (one made again under the name)

    def lookup(self, username: str) -> tuple[str, User]:
        self.lookups += 1
        if self.down:
            raise Unavailable("Keycloak refused (no answer)")
        if username not in self.users:
            raise NotFound(f"no user named {username!r}")
        return self.ids.get(username, f"id-{username}"), self.users[username]


def make(home: Home, name: str = "app", owner: str = "kate", **fields: object) -> str:
    return api_keys.create(home, api_keys.NewKey(name=name, owner=owner, **fields), owner_id=f"id-{owner}",
                           created_by="admin").secret


def who(keys: KeyAuthenticator, secret: str) -> object:
    return asyncio.run(keys.principal(secret))


def refusal(keys: KeyAuthenticator, secret: str) -> AuthError:
    with pytest.raises(AuthError) as caught:
        asyncio.run(keys.principal(secret))
    return caught.value


def test_a_key_is_shown_once_and_kept_only_as_a_keyed_hash(home: Home) -> None:
    secret = make(home)
    assert secret.startswith("apk-") and len(secret) == 47 and api_keys.well_formed(secret)
    stored = api_keys.registry(home).path.read_text()
    assert secret not in stored and secret[4:] not in stored
    assert os.stat(api_keys.registry(home).path).st_mode & 0o777 == 0o600
    assert (home.secrets / api_keys.HMAC_SECRET).stat().st_mode & 0o777 == 0o600
    assert make(home, "other") != secret
    with pytest.raises(Conflict):
        make(home)


def test_the_principal_acts_as_its_owner_with_the_roles_keycloak_gives_now(home: Home) -> None:
    realm = Realm()
    keys = KeyAuthenticator(home, realm.lookup, owner_ttl_s=60)
    secret = make(home, models=["m1"])
    principal = who(keys, secret)
    assert (principal.subject, principal.username, principal.client, principal.key) == ("id-kate", "kate",
                                                                                          "key:app", "app")
    assert principal.roles == {"user"} and principal.models == {"m1"}
    assert principal.may_use("m1") and principal.may_use("m1:fast") and not principal.may_use("m2")
    who(keys, secret)
    assert realm.lookups == 1, "the owner is looked up once per interval"
    assert "kate/app" in api_keys.uses(home).read()


def test_the_owners_are_looked_up_ahead_once_keycloak_answers(home: Home) -> None:
    """At a start the gateway looks the keys' owners up (Keycloak may answer only later), so that
    the first request with a key does not wait on Keycloak; the entry still expires as any other."""
    realm = Realm()
    realm.down = True
    keys = KeyAuthenticator(home, realm.lookup, owner_ttl_s=60)
    secret = make(home)
    make(home, "gone", expires_in="1h")
    with api_keys.registry(home).change() as registry:  # an expired key's owner is not looked up
        registry["kate/gone"] = registry["kate/gone"].model_copy(update={"owner": "nobody",
                                                               "expires": datetime.now(UTC) - timedelta(seconds=1)})

    async def warm_while_keycloak_starts() -> None:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(functools.partial(keys.warm, retry_s=0.01))
            await anyio.sleep(0.05)
            realm.down = False  # Keycloak answers now

    anyio.run(warm_while_keycloak_starts)
    assert realm.lookups >= 2
    looked_up = realm.lookups
    assert who(keys, secret).username == "kate" and realm.lookups == looked_up  # no wait on Keycloak
    realm.down = True
    anyio.run(functools.partial(KeyAuthenticator(home, realm.lookup, owner_ttl_s=60).warm, retry_s=0.01,
                                give_up_s=0.05))  # Keycloak never answers: it gives up, fails nothing


def test_revoked_expired_unknown_disabled_and_gone_keys_are_refused(home: Home) -> None:
    realm = Realm()
    keys = KeyAuthenticator(home, realm.lookup, owner_ttl_s=0)
    secret = make(home)
    who(keys, secret)
    api_keys.revoke(home, "kate", "app")
    assert refusal(keys, secret).reason == "revoked_key"  # at once: the registry changed
    assert api_keys.revoke(home, "kate", "app").revoked is not None  # again: no change, no error
    with pytest.raises(NotFound):
        api_keys.revoke(home, "kate", "nothing")

    stale = make(home, "stale", expires_in="1h")
    with api_keys.registry(home).change() as registry:
        registry["kate/stale"] = registry["kate/stale"].model_copy(update={"expires": datetime.now(UTC)
                                                                             - timedelta(seconds=1)})
    assert refusal(keys, stale).reason == "expired_key"

    assert refusal(keys, "apk-" + "A" * 43).reason == "invalid_key"
    assert refusal(keys, secret + "\n").reason == "malformed"
    live = make(home, "live")
    realm.users["kate"] = User(username="kate", enabled=False, roles=[Role.USER])
    assert refusal(keys, live).reason == "inactive"
    del realm.users["kate"]
    assert refusal(keys, live).reason == "inactive"
    realm.down = True
    failed = refusal(keys, live)
    assert failed.reason == "introspection_unavailable" and failed.status == 503  # closed, not open


def test_a_corrupt_registry_fails_closed(home: Home) -> None:
    keys = KeyAuthenticator(home, Realm().lookup, owner_ttl_s=60)
    secret = make(home)
    api_keys.registry(home).path.write_text("{not json")
    failed = refusal(keys, secret)
    assert failed.status == 503 and failed.reason == "keys_unavailable"


def test_a_user_made_later_under_the_same_name_is_not_the_keys_owner(home: Home) -> None:
    """A key is bound to its owner's id in Keycloak: delete the user, make another of that name
    (with more roles), and the old key stays refused."""
    realm = Realm()
    keys = KeyAuthenticator(home, realm.lookup, owner_ttl_s=0)
    secret = make(home)
    who(keys, secret)
    realm.users["kate"] = User(username="kate", enabled=True, roles=[Role.USER, Role.ADMIN])
    realm.ids["kate"] = "id-kate-2"
    assert refusal(keys, secret).reason == "inactive"


def test_a_deleted_owners_key_costs_one_lookup_per_interval(home: Home) -> None:
    realm = Realm()
    keys = KeyAuthenticator(home, realm.lookup, owner_ttl_s=60)
    secret = make(home)
    del realm.users["kate"]
    for _ in range(5):
        assert refusal(keys, secret).reason == "inactive"
    assert realm.lookups == 1, "a user found missing is remembered as missing for the interval"


def test_a_revoked_or_expired_key_is_removed_an_active_one_is_not(home: Home) -> None:
    make(home, "live")
    make(home, "old")
    api_keys.revoke(home, "kate", "old")
    with pytest.raises(Conflict, match="active"):
        api_keys.remove(home, "kate", "live")
    assert api_keys.remove(home, "kate", "old").name == "old"
    make(home, "old")  # its name is free again


def test_one_user_holds_a_bounded_number_of_keys(home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api_keys, "MAX_KEYS_PER_OWNER", 2)
    make(home, "a")
    make(home, "b")
    api_keys.revoke(home, "kate", "b")
    with pytest.raises(QuotaExceeded, match="kate has 2 API keys"):
        make(home, "c")


@pytest.mark.parametrize("models", [["x" * 129], ["a\nb"], ["../m"], [f"m{n}" for n in range(17)], [], [""]])
def test_a_keys_models_are_names_and_few(models: list[str]) -> None:
    with pytest.raises(ValueError, match="models"):
        api_keys.NewKey(name="k", owner="kate", models=models)


@pytest.mark.parametrize("expires_in", ["999999w", "522w", "3654d", "87700h"])
def test_an_expiry_past_ten_years_is_refused_not_a_crash(home: Home, expires_in: str) -> None:
    with pytest.raises(Invalid, match="ten years"):
        make(home, expires_in=expires_in)


@pytest.mark.parametrize("expires_in", ["1d\n", "tomorrow", "0h", "1", "-1d", "1.5d", "1d ", "１d", "9999999d", ""])
def test_a_bad_duration_names_the_field(home: Home, expires_in: str) -> None:
    with pytest.raises(Invalid, match="expires_in"):
        make(home, expires_in=expires_in)


@pytest.mark.parametrize("name", ["../x", "A", "", "a" * 65, "a\nb", "kéy", "a b", "a\u200bb", ".hidden"])
def test_a_bad_name_is_refused(home: Home, name: str) -> None:
    with pytest.raises(ValueError, match="name"):
        api_keys.NewKey(name=name, owner="kate")


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80))
def test_any_hostile_bearer_is_refused_not_crashed(tmp_path_factory: pytest.TempPathFactory, bearer: str) -> None:
    home = Home(tmp_path_factory.mktemp("h") / "h").ensure()
    keys = KeyAuthenticator(home, Realm().lookup, owner_ttl_s=60)
    failed = refusal(keys, "apk-" + bearer)
    assert failed.reason in ("malformed", "invalid_key")


def test_a_keys_token_budget_holds_beside_its_owners_and_gives_back_both() -> None:
    limiter = RateLimiter({"user": RoleLimits(tokens_per_minute=10_000)})
    owner = limiter.admit("id-kate", frozenset({"user"}), prompt_tokens=100, completion_tokens=200)
    owner.also = limiter.admit_key("app", 500, prompt_tokens=100, completion_tokens=200)
    with pytest.raises(GatewayError) as refused:  # 300 of the key's 500 are held
        limiter.admit_key("app", 500, prompt_tokens=100, completion_tokens=200)
    assert refused.value.status == 429 and "API key app" in refused.value.message
    owner.settle(50, 10)  # both budgets charged what was used, the rest given back
    again = limiter.admit_key("app", 500, prompt_tokens=100, completion_tokens=300)
    again.settle(0, 0)
    with pytest.raises(GatewayError) as never:
        limiter.admit_key("app", 500, prompt_tokens=400, completion_tokens=200)
    assert never.value.status == 400 and never.value.code == "exceeds_token_budget"


def test_names_are_scoped_per_owner_and_tell_nothing_of_other_users_keys(home: Home) -> None:
    realm = Realm()
    realm.users["liam"] = User(username="liam", enabled=True, roles=[Role.USER])
    keys = KeyAuthenticator(home, realm.lookup, owner_ttl_s=60)
    kates, liams = make(home, "ci"), make(home, "ci", owner="liam")  # two users, one name: no 409
    assert {(who(keys, kates).username, who(keys, liams).username)} == {("kate", "liam")}  # type: ignore[attr-defined]
    with pytest.raises(Conflict, match="kate already has an API key named 'ci'"):
        make(home, "ci")
    api_keys.revoke(home, "liam", "ci")
    assert refusal(keys, liams).reason == "revoked_key" and who(keys, kates).key == "ci"  # type: ignore[attr-defined]
    assert keys.named("kate", "ci").owner == "kate"
    with pytest.raises(AuthError, match="revoked"):
        keys.named("liam", "ci")
    with pytest.raises(NotFound, match="liam has no API key named 'cd'"):
        api_keys.get(home, "liam", "cd")
    assert [(key.owner, key.name) for key in api_keys.listing(home)] == [("kate", "ci"), ("liam", "ci")]
    assert api_keys.owners_of(home, "ci") == ["kate", "liam"]
    assert set(api_keys.uses(home).read()) == {"kate/ci", "liam/ci"}, "each key's use is its own"


Op = tuple[str, str, str]  # operation, owner, name


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["create", "revoke", "remove", "get"]), st.sampled_from(["kate", "liam"]),
                          st.sampled_from(["ci", "cd"])), max_size=20))
def test_what_happens_to_ones_keys_never_depends_on_anothers(tmp_path_factory: pytest.TempPathFactory,
                                                            ops: list[Op]) -> None:
    """Each user's operations answer as if they were alone on the appliance."""
    together = Home(tmp_path_factory.mktemp("h") / "h").ensure()
    alone = {owner: Home(tmp_path_factory.mktemp("h") / "h").ensure() for owner in ("kate", "liam")}

    def outcome(home: Home, op: str, owner: str, name: str) -> str:
        try:
            if op == "create":
                make(home, name, owner=owner)
            elif op == "get":
                api_keys.get(home, owner, name)
            else:
                getattr(api_keys, op)(home, owner, name)
        except (Conflict, NotFound) as exc:
            return f"{type(exc).__name__}: {exc.message}"
        return "done"

    for op, owner, name in ops:
        assert outcome(together, op, owner, name) == outcome(alone[owner], op, owner, name), (op, owner, name)


def test_a_registry_from_when_names_were_unique_keeps_working_and_is_reindexed(home: Home) -> None:
    realm = Realm()
    realm.users["liam"] = User(username="liam", enabled=True, roles=[Role.USER])
    secret = make(home, "ci")
    with api_keys.registry(home).change() as registry:  # indexed by name alone, as it was written then
        registry["ci"] = registry.pop("kate/ci")
    with api_keys.uses(home).change() as used:
        used["ci"] = datetime(2026, 1, 2, 3, 4, tzinfo=UTC)
    keys = KeyAuthenticator(home, realm.lookup, owner_ttl_s=60)
    assert api_keys.get(home, "kate", "ci").name == "ci" and keys.named("kate", "ci").owner == "kate"
    assert api_keys.last_uses(home) == {"kate/ci": datetime(2026, 1, 2, 3, 4, tzinfo=UTC)}
    make(home, "ci", owner="liam")  # the first change re-indexes the registry and the use record
    assert set(api_keys.registry(home).read()) == {"kate/ci", "liam/ci"}
    assert api_keys.uses(home).read() == {"kate/ci": datetime(2026, 1, 2, 3, 4, tzinfo=UTC)}
    assert who(keys, secret).username == "kate"  # type: ignore[attr-defined]
    with pytest.raises(Conflict):
        make(home, "ci")
    api_keys.revoke(home, "kate", "ci")
    assert refusal(keys, secret).reason == "revoked_key"


@pytest.mark.parametrize(("change", "expected"), [
    (lambda realm: None, {"user"}),
    (lambda realm: realm.users.update(kate=User(username="kate", enabled=True, roles=[Role.TRAINER])), {"trainer"}),
    (lambda realm: realm.users.update(kate=User(username="kate", enabled=False, roles=[Role.USER])), "inactive 403"),
    (lambda realm: realm.users.pop("kate"), "inactive 403"),
    (lambda realm: realm.ids.update(kate="id-kate-2"), "inactive 403"),  # another user of the same name
    (lambda realm: setattr(realm, "down", True), "introspection_unavailable 503"),
])
def test_a_batch_owners_roles_are_those_they_hold_now(home: Home, change: object, expected: object) -> None:
    """What the gateway checks before each batch request: the owner's roles now, or why not."""
    realm = Realm()
    change(realm)  # type: ignore[operator]
    keys = KeyAuthenticator(home, realm.lookup, owner_ttl_s=0)
    try:
        found: object = asyncio.run(keys.roles_now("kate", "id-kate"))
    except AuthError as exc:
        found = f"{exc.reason} {exc.status}"
    assert found == expected


_T0 = datetime(2026, 1, 1, tzinfo=UTC)
_OFFSETS = st.none() | st.integers(min_value=-3, max_value=3).map(lambda hours: _T0 + timedelta(hours=hours))


def _key(revoked: datetime | None = None, expires: datetime | None = None,
         models: list[str] | None = None) -> api_keys.ApiKey:
    return api_keys.ApiKey(name="app", owner="kate", owner_id="id-kate", created=_T0 - timedelta(days=1),
                           created_by="admin", expires=expires, models=models, tokens_per_minute=None,
                           prefix="apk-abcdef", digest="0" * 64, revoked=revoked)


@settings(max_examples=200)
@given(revoked=_OFFSETS, expires=_OFFSETS, now=st.integers(min_value=-4, max_value=4))
def test_the_gateway_refuses_a_key_exactly_when_its_state_is_not_active(revoked: datetime | None,
                                                                        expires: datetime | None, now: int) -> None:
    key, at = _key(revoked, expires), _T0 + timedelta(hours=now)
    state = key.state(at)
    try:
        usable(key, at)
    except AuthError as refused:
        decided = refused.reason
    else:
        decided = "active"
    assert decided == {api_keys.KeyState.ACTIVE: "active", api_keys.KeyState.REVOKED: "revoked_key",
                       api_keys.KeyState.EXPIRED: "expired_key"}[state]
    assert view(key, None).state is key.state(datetime.now(UTC)), "the admin API shows the state the gateway uses"


def test_the_key_view_shows_every_field_of_a_key_but_its_hash() -> None:
    # ApiKey declares only what no view may show: a field added to a key (in KeyDetails) is in the
    # view with no second edit; one added to ApiKey itself fails here until it is one or the other.
    assert set(api_keys.ApiKey.model_fields) - set(api_keys.KeyDetails.model_fields) == {"digest"}
    assert set(KeyView.model_fields) == set(api_keys.KeyDetails.model_fields) | {"state", "last_used"}
    key = _key(expires=_T0 + timedelta(days=30), models=["m1"])
    shown = view(key, _T0).model_dump()
    assert "digest" not in shown
    assert {name: shown[name] for name in api_keys.KeyDetails.model_fields} == key.model_dump(exclude={"digest"})


def test_a_keys_principal_is_built_one_way_for_its_own_requests_and_its_batches() -> None:
    expires = _T0 + timedelta(days=1)
    key = _key(expires=expires, models=["m1"])
    own = Principal.for_key(key, subject="id-kate", roles=frozenset({"user"}))
    assert (own.username, own.client, own.token_id, own.key, own.models) == ("kate", "key:app", "key:kate/app",
                                                                             "app", frozenset({"m1"}))
    assert own.expires_at == expires.timestamp()
    batch = Principal.for_key(key, subject="id-kate", roles=frozenset({"user"}), client="batch-worker",
                              token_id="batch_1:3", expires_at=float("inf"))
    assert (batch.key, batch.models, batch.tokens_per_minute) == (own.key, own.models, own.tokens_per_minute)
    assert Principal.for_key(_key(), subject="s", roles=frozenset()).expires_at == float("inf")


def test_a_keys_listed_state_is_what_the_gateway_would_do_with_it(home: Home) -> None:
    """`keys list` (the admin API's listing) shows a disabled or gone owner's key as refused, as
    the gateway refuses it, not as active; unconfirmed while Keycloak does not answer."""
    realm = Realm()
    keys = KeyAuthenticator(home, realm.lookup, owner_ttl_s=0)
    secret = make(home)
    key = api_keys.listing(home, None)[0]

    def standing() -> api_keys.KeyState:
        return asyncio.run(keys.standing(key, datetime.now(UTC)))

    assert standing() is api_keys.KeyState.ACTIVE
    realm.users["kate"] = User(username="kate", enabled=False, roles=[Role.USER])
    assert standing() is api_keys.KeyState.OWNER_DISABLED and refusal(keys, secret).reason == "inactive"
    realm.users["kate"] = User(username="kate", enabled=True, roles=[Role.USER])
    realm.ids["kate"] = "id-kate-2"  # another user made under the name
    assert standing() is api_keys.KeyState.OWNER_GONE and refusal(keys, secret).reason == "inactive"
    del realm.users["kate"]
    assert standing() is api_keys.KeyState.OWNER_GONE
    realm.down = True
    assert standing() is api_keys.KeyState.OWNER_UNCONFIRMED and refusal(keys, secret).status == 503
    revoked = api_keys.revoke(home, "kate", "app")
    lookups = realm.lookups
    assert asyncio.run(keys.standing(revoked, datetime.now(UTC))) is api_keys.KeyState.REVOKED
    assert realm.lookups == lookups, "the key's own state needs no lookup"
    assert view(key, None, api_keys.KeyState.OWNER_DISABLED).state is api_keys.KeyState.OWNER_DISABLED
