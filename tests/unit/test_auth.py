"""Token validation with a local key set served by httpx.MockTransport (no Keycloak needed)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from jwcrypto import jwk, jws

from serve.auth import TokenValidator
from serve.errors import AuthError

ISSUER = "http://idp.test/realms/appliance"


def make_key(kid: str) -> jwk.JWK:
    return jwk.JWK.generate(kty="RSA", size=2048, kid=kid)


def sign(key: jwk.JWK, claims: dict, alg: str = "RS256") -> str:
    token = jws.JWS(json.dumps(claims).encode())
    token.add_signature(key, alg=alg, protected=json.dumps({"alg": alg, "kid": key.key_id}))
    return token.serialize(compact=True)


def claims(**changes: object) -> dict:
    now = int(time.time())
    base = {"iss": ISSUER, "aud": ["appliance-gateway"], "sub": "u1", "typ": "Bearer", "exp": now + 60,
            "preferred_username": "alice", "realm_access": {"roles": ["user"]}, "azp": "cli", "jti": "j1"}
    base.update(changes)
    return {k: v for k, v in base.items() if v is not None}


class FakeRealm:
    """Serves a JWKS and counts fetches."""

    def __init__(self, *keys: jwk.JWK) -> None:
        self.keys = list(keys)
        self.fetches = 0

    def handler(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path.endswith("/protocol/openid-connect/certs")
        self.fetches += 1
        keyset = jwk.JWKSet()
        for key in self.keys:
            keyset.add(jwk.JWK(**key.export_public(as_dict=True)))
        return httpx.Response(200, text=keyset.export(private_keys=False))


def validate(realm: FakeRealm, header: str | None, leeway_s: int = 5, **kwargs: object) -> object:
    async def go() -> object:
        async with httpx.AsyncClient(transport=httpx.MockTransport(realm.handler)) as http:
            validator = TokenValidator(issuer=ISSUER, audience="appliance-gateway", http=http, leeway_s=leeway_s,
                                       **kwargs)
            return await validator.validate(header)

    return asyncio.run(go())


def test_valid_token_gives_principal() -> None:
    key = make_key("k1")
    who = validate(FakeRealm(key), f"Bearer {sign(key, claims())}")
    assert who.subject == "u1" and who.username == "alice" and who.roles == {"user"}


@pytest.mark.parametrize("changes,reason", [
    ({"iss": ISSUER + "x"}, "bad_issuer"),
    ({"aud": "someone-else"}, "bad_audience"),
    ({"exp": -10}, "expired"),
    ({"nbf": 60}, "not_yet_valid"),
    ({"typ": "Refresh"}, "bad_type"),
    ({"sub": None}, "malformed"),
])
def test_claims_are_checked(changes: dict, reason: str) -> None:
    # Times are offsets from now, taken when the test runs (not when it is collected).
    changes = {k: int(time.time()) + v if k in ("exp", "nbf") else v for k, v in changes.items()}
    key = make_key("k1")
    with pytest.raises(AuthError) as caught:
        validate(FakeRealm(key), f"Bearer {sign(key, claims(**changes))}")
    assert caught.value.reason == reason and caught.value.status == 401


def test_leeway_accepts_small_skew() -> None:
    key = make_key("k1")
    token = f"Bearer {sign(key, claims(exp=int(time.time()) - 2))}"  # expired 2 s ago
    who = validate(FakeRealm(key), token, leeway_s=5)
    assert who.subject == "u1" and who.username == "alice"
    with pytest.raises(AuthError) as caught:  # the same token without leeway
        validate(FakeRealm(key), token, leeway_s=0)
    assert caught.value.reason == "expired"


def test_unknown_kid_refetches_at_most_once_per_interval() -> None:
    old, new = make_key("old"), make_key("new")
    realm = FakeRealm(old)

    async def go() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(realm.handler)) as http:
            validator = TokenValidator(issuer=ISSUER, audience="appliance-gateway", http=http,
                                       refetch_interval_s=3600)
            await validator.validate(f"Bearer {sign(old, claims())}")
            assert realm.fetches == 1
            stranger = make_key("stranger")
            for _ in range(5):
                with pytest.raises(AuthError, match="unknown key"):
                    await validator.validate(f"Bearer {sign(stranger, claims())}")
            assert realm.fetches == 1, "a flood of unknown kids must not hammer Keycloak"

        realm.keys.append(new)  # key rotation: a fresh validator (interval elapsed) finds it
        async with httpx.AsyncClient(transport=httpx.MockTransport(realm.handler)) as http:
            validator = TokenValidator(issuer=ISSUER, audience="appliance-gateway", http=http,
                                       refetch_interval_s=0)
            await validator.validate(f"Bearer {sign(old, claims())}")
            await validator.validate(f"Bearer {sign(new, claims())}")

    asyncio.run(go())


def test_symmetric_and_none_algorithms_refused() -> None:
    key = make_key("k1")
    secret = jwk.JWK.generate(kty="oct", size=256, kid="k1")
    with pytest.raises(AuthError) as caught:
        validate(FakeRealm(key), f"Bearer {sign(secret, claims(), alg='HS256')}")
    assert caught.value.reason == "bad_algorithm"
    header = "eyJhbGciOiJub25lIiwia2lkIjoiazEifQ"  # {"alg":"none","kid":"k1"}
    with pytest.raises(AuthError) as caught:
        validate(FakeRealm(key), f"Bearer {header}.{sign(key, claims()).split('.')[1]}.")
    assert caught.value.reason == "bad_algorithm"


def test_verified_token_is_remembered_but_its_expiry_still_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    key = make_key("k1")
    realm = FakeRealm(key)
    token = f"Bearer {sign(key, claims(exp=int(time.time()) + 60))}"

    async def go() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(realm.handler)) as http:
            validator = TokenValidator(issuer=ISSUER, audience="appliance-gateway", http=http, leeway_s=0)
            await validator.validate(token)
            verified = validator._verify
            calls = []
            monkeypatch.setattr(validator, "_verify", lambda t: calls.append(t) or verified(t))
            await validator.validate(token)
            assert calls == [], "a repeat of a verified token skips the signature check"
            later = time.time() + 120
            monkeypatch.setattr("serve.auth.time.time", lambda: later)
            with pytest.raises(AuthError) as caught:
                await validator.validate(token)
            assert caught.value.reason == "expired"

    asyncio.run(go())


def test_withdrawn_key_invalidates_remembered_tokens() -> None:
    old, new = make_key("old"), make_key("new")
    realm = FakeRealm(old, new)
    token = f"Bearer {sign(old, claims())}"

    async def go() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(realm.handler)) as http:
            validator = TokenValidator(issuer=ISSUER, audience="appliance-gateway", http=http)
            await validator.validate(token)
            realm.keys.remove(old)  # the realm rotates the old key out
            await validator.refresh_keys()
            with pytest.raises(AuthError) as caught:
                await validator.validate(token)
            assert caught.value.reason == "unknown_key"

    asyncio.run(go())
