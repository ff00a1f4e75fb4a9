"""Bearer-token validation against the realm's JWKS, locally: no call to Keycloak per request.

Checks, in order: token present and well formed; `alg` in the asymmetric allow-list; `kid` known
(the JWKS is refetched on a miss, at most once per interval); signature; `iss` exactly the realm;
`aud` contains the gateway client; `exp`/`nbf` with leeway; `typ` is Bearer (not ID or refresh
tokens). A user disabled after the token was issued is caught by optional, cached introspection.
A token whose signature checked out is remembered (until the key set changes), so a client's
repeat requests skip the signature work; its claims, expiry included, are checked every time.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
from jwcrypto import jwk, jws
from jwcrypto.common import JWException

from appliance.api_keys import ApiKey, ref
from serve.errors import AuthError

VERIFIED_CACHE_SIZE = 4096
ALLOWED_ALGS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA")


def key_client(name: str) -> str:
    """How the audit log names API key `name` as what called: the same whether it was let in or refused."""
    return f"key:{name}"


@dataclass(frozen=True)
class Principal:
    """Who a valid token speaks for."""

    subject: str
    username: str
    client: str
    roles: frozenset[str]
    token_id: str
    expires_at: float
    key: str | None = None  # the API key it acts by (serve.api_keys)
    models: frozenset[str] | None = None  # the models that key is limited to
    tokens_per_minute: int | None = None  # that key's own token budget, on top of its owner's

    @classmethod
    def for_key(cls, key: ApiKey, *, subject: str, roles: frozenset[str], client: str | None = None,
                token_id: str | None = None, expires_at: float | None = None) -> Principal:
        """The principal acting by API key `key` as its owner (`subject`, holding `roles`), within the
        key's scope and budget; by default the key's own request (client, id and expiry of the key),
        else another's by it (a batch's request: serve.deps)."""
        if expires_at is None:
            expires_at = key.expires.timestamp() if key.expires is not None else float("inf")
        return cls(subject=subject, username=key.owner, client=client or key_client(key.name), roles=roles,
                   token_id=token_id or f"key:{ref(key.owner, key.name)}", expires_at=expires_at, key=key.name,
                   models=frozenset(key.models) if key.models is not None else None,
                   tokens_per_minute=key.tokens_per_minute)

    def may_use(self, model: str) -> bool:
        """Whether its key's scope admits `model` (a tier asked by name, MODEL:TIER, by its model)."""
        return self.models is None or model in self.models or model.rpartition(":")[0] in self.models


class TokenValidator:
    """Validates access tokens of one realm for one audience."""

    def __init__(self, *, issuer: str, audience: str, http: httpx.AsyncClient, leeway_s: int = 30,
                 refetch_interval_s: float = 30.0, introspect: Introspector | None = None,
                 on_fetch: Callable[[], None] = lambda: None, realm_url: str | None = None) -> None:
        """`issuer`: the tokens' `iss`; `realm_url`: where the realm's keys are fetched (its
        backchannel on this host), the issuer itself if None."""
        self.issuer = issuer
        self.audience = audience
        self.jwks_url = f"{realm_url or issuer}/protocol/openid-connect/certs"
        self._http = http
        self._leeway = leeway_s
        self._refetch_interval = refetch_interval_s
        self._keys = jwk.JWKSet()
        self._fetched_at = float("-inf")
        self._lock = asyncio.Lock()
        self._introspect = introspect
        self._on_fetch = on_fetch
        self._verified: dict[str, object] = {}  # token -> its claims, signature checked

    @property
    def has_keys(self) -> bool:
        """Whether the realm's signing keys have been fetched."""
        return bool(self._keys.get("keys"))

    async def try_refresh_keys(self) -> bool:
        """Fetch the JWKS now; False if Keycloak did not give it (it may still be starting)."""
        try:
            await self.refresh_keys()
        except httpx.HTTPError:
            return False
        return True

    async def refresh_keys(self) -> None:
        """Fetch the JWKS now (raises httpx errors: the caller decides what that means)."""
        self._on_fetch()
        response = await self._http.get(self.jwks_url, timeout=5.0)
        response.raise_for_status()
        self._keys = jwk.JWKSet.from_json(response.text)
        self._fetched_at = time.monotonic()
        self._verified.clear()  # a key may have been withdrawn

    async def _key(self, kid: str) -> jwk.JWK | None:
        key = self._keys.get_key(kid)
        if key is not None:
            return key
        async with self._lock:
            key = self._keys.get_key(kid)
            if key is None and time.monotonic() - self._fetched_at >= self._refetch_interval:
                try:
                    await self.refresh_keys()
                except httpx.HTTPError as exc:
                    raise AuthError("jwks_unavailable", "signing keys unavailable; try again",
                                    status=503) from exc
                key = self._keys.get_key(kid)
        return key

    async def validate(self, authorization: str | None) -> Principal:
        """The principal of a valid `Authorization: Bearer` value, else AuthError."""
        token = _bearer(authorization)
        claims = self._verified.get(token)
        if claims is None:
            claims = await self._verify(token)
            self._remember(token, claims)
        principal = self._check_claims(claims)
        if self._introspect is not None:
            await self._introspect.check(token, principal)
        return principal

    async def _verify(self, token: str) -> object:
        """The claims of a token signed by a key of the realm with an allowed algorithm."""
        header = _header(token)
        alg = header.get("alg")
        if alg not in ALLOWED_ALGS:
            raise AuthError("bad_algorithm", f"token algorithm {alg!r} is not allowed")
        kid = header.get("kid")
        if not isinstance(kid, str) or not kid:
            raise AuthError("unknown_key", "token has no key id")
        key = await self._key(kid)
        if key is None:
            raise AuthError("unknown_key", "token signed with an unknown key")
        signed = jws.JWS()
        signed.allowed_algs = list(ALLOWED_ALGS)
        try:
            signed.deserialize(token)
            signed.verify(key, alg=alg)
            return json.loads(signed.payload)
        except (JWException, ValueError, TypeError) as exc:
            raise AuthError("bad_signature", "token signature is invalid") from exc

    def _remember(self, token: str, claims: object) -> None:
        if len(self._verified) >= VERIFIED_CACHE_SIZE:
            now = time.time()
            self._verified = {t: c for t, c in self._verified.items()
                              if isinstance(c, dict) and isinstance(c.get("exp"), (int, float))
                              and c["exp"] + self._leeway > now}
            if len(self._verified) >= VERIFIED_CACHE_SIZE:
                self._verified.clear()
        self._verified[token] = claims

    def _check_claims(self, claims: object) -> Principal:
        if not isinstance(claims, dict):
            raise AuthError("malformed", "token payload is not a JSON object")
        now = time.time()
        if claims.get("iss") != self.issuer:
            raise AuthError("bad_issuer", "token was issued by another issuer")
        audience = claims.get("aud")
        audiences = audience if isinstance(audience, list) else [audience]
        if self.audience not in audiences:
            raise AuthError("bad_audience", "token is not meant for this gateway")
        exp = claims.get("exp")
        if not isinstance(exp, (int, float)):
            raise AuthError("malformed", "token has no expiry")
        if now > exp + self._leeway:
            raise AuthError("expired", "token has expired")
        nbf = claims.get("nbf")
        if isinstance(nbf, (int, float)) and now < nbf - self._leeway:
            raise AuthError("not_yet_valid", "token is not valid yet")
        if claims.get("typ") != "Bearer":
            raise AuthError("bad_type", "not an access token")
        subject = claims.get("sub")
        if not isinstance(subject, str) or not subject:
            raise AuthError("malformed", "token has no subject")
        roles = (claims.get("realm_access") or {}).get("roles") or []
        return Principal(subject=subject, username=str(claims.get("preferred_username") or subject),
                         client=str(claims.get("azp") or ""), roles=frozenset(map(str, roles)),
                         token_id=str(claims.get("jti") or ""), expires_at=float(exp))


class Introspector:
    """Asks Keycloak whether a token is still active (user enabled, session alive), caching the
    answer per token for `ttl_s`: a disabled user's token stops working within `ttl_s`."""

    def __init__(self, *, issuer: str, client_id: str, client_secret: str, http: httpx.AsyncClient,
                 ttl_s: float, realm_url: str | None = None) -> None:
        self._url = f"{realm_url or issuer}/protocol/openid-connect/token/introspect"
        self._auth = (client_id, client_secret)
        self._http = http
        self._ttl = ttl_s
        self._cache: dict[str, tuple[float, bool]] = {}

    async def check(self, token: str, principal: Principal) -> None:
        key = principal.token_id or token
        now = time.monotonic()
        cached = self._cache.get(key)
        if cached is None or now - cached[0] > self._ttl:
            try:
                response = await self._http.post(self._url, data={"token": token}, auth=self._auth,
                                                 timeout=5.0)
                response.raise_for_status()
                active = bool(response.json().get("active"))
            except (httpx.HTTPError, ValueError) as exc:
                raise AuthError("introspection_unavailable", "cannot confirm the token; try again",
                                status=503) from exc
            if len(self._cache) > 10_000:
                self._cache = {k: v for k, v in self._cache.items() if now - v[0] <= self._ttl}
            self._cache[key] = cached = (now, active)
        if not cached[1]:
            raise AuthError("inactive", "token is no longer active (user disabled or logged out)")


def _bearer(authorization: str | None) -> str:
    if not authorization:
        raise AuthError("missing_token", "no bearer token")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthError("malformed", "Authorization must be 'Bearer <token>'")
    return token.strip()


def _header(token: str) -> dict[str, Any]:
    parts = token.split(".")
    if len(parts) != 3 or not all(parts[:2]):
        raise AuthError("malformed", "token is not a signed JWT")
    try:
        header = json.loads(base64.urlsafe_b64decode(parts[0] + "=" * (-len(parts[0]) % 4)))
    except (ValueError, TypeError) as exc:
        raise AuthError("malformed", "token header is not valid") from exc
    if not isinstance(header, dict):
        raise AuthError("malformed", "token header is not valid")
    return header
