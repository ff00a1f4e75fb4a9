"""Tokens for the CLI and TUI: device-code or password login against the realm of a connection
(this host's appliance or a remote one, appliance.connection), cached 0600 per user and realm,
refreshed."""

from __future__ import annotations

import base64
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from appliance import connection as connections
from appliance.connection import Connection
from appliance.durable import replace_file
from appliance.errors import ApplianceError
from appliance.home import Home
from appliance.secrets import rl_client_secret
from appliance.settings import Settings

DEVICE_CODE = re.compile(r"[A-Z0-9-]{4,32}")  # Keycloak's user codes: XXXX-XXXX
PRINTABLE = re.compile(r"[\x21-\x7e]{1,2048}")  # a link shown as it is: no spaces, controls or escapes
# Refresh when less than this is left, so a command never starts with a token about to expire.
MARGIN_S = 30


class LoginError(ApplianceError):
    """Keycloak refused a login or a refresh."""


class KeycloakUnreachable(LoginError):
    """Keycloak could not be reached (down, restarting): worth trying again."""


@dataclass
class CachedToken:
    username: str
    access_token: str
    refresh_token: str
    expires_at: float
    refresh_expires_at: float

    @classmethod
    def from_response(cls, username: str, body: dict[str, Any]) -> CachedToken:
        now = time.time()
        return cls(username=username, access_token=body["access_token"],
                   refresh_token=body.get("refresh_token", ""),
                   expires_at=now + float(body.get("expires_in", 0)),
                   refresh_expires_at=now + float(body.get("refresh_expires_in", 0)))


def save(connection: Connection, token: CachedToken) -> None:
    path = connection.token_cache
    path.parent.mkdir(mode=0o700, exist_ok=True)
    replace_file(path, json.dumps(asdict(token)).encode())


def _post(connection: Connection, name: str, data: dict[str, str]) -> httpx.Response:
    try:
        return httpx.post(f"{connection.realm_url}/protocol/openid-connect/{name}",
                          data={"client_id": connection.client_id, **data}, timeout=30,
                          verify=connection.keycloak_trust())
    except httpx.HTTPError as exc:
        raise KeycloakUnreachable(f"Keycloak at {connection.realm_url} is not reachable: {exc}",
                                  hint="is the appliance up? (`appliance status`)") from exc


def service_token(settings: Settings, home: Home) -> CachedToken:
    """A token of the RL loop's service identity (client credentials of `rl.client_id`), not cached:
    it is asked for again when it nears its end."""
    response = _post(connections.local(settings, home), "token", {
        "grant_type": "client_credentials", "client_id": settings.rl.client_id,
        "client_secret": rl_client_secret(home)})
    if response.status_code != 200:
        raise _refused(response)
    return CachedToken.from_response(f"service-account-{settings.rl.client_id}", response.json())


def _refused(response: httpx.Response) -> LoginError:
    try:
        body = response.json()
        reason = body.get("error_description") or body.get("error") or response.text
    except ValueError:
        reason = response.text[:200]
    return LoginError(f"Keycloak refused the login: {reason}")


def password_login(connection: Connection, username: str, password: str, *, cache: bool = True) -> CachedToken:
    """Log in with a password (for scripts); the token is cached unless `cache` is False (a token
    printed for another user must not replace the cached login)."""
    response = _post(connection, "token", {"grant_type": "password", "username": username, "password": password})
    if response.status_code != 200:
        refused = _refused(response)
        # Keycloak tells a locked account and a wrong password apart to no one; say both.
        refused.hint = ("the password grant is off (keycloak.cli_password_grant): log in with `appliance token`"
                        if "direct access grants" in refused.message else
                        "a wrong password, or an account locked for a while after repeated wrong passwords")
        raise refused
    token = CachedToken.from_response(username, response.json())
    if cache:
        save(connection, token)
    return token


def device_login(connection: Connection, show: Callable[[str, str], None]) -> CachedToken:
    """The device authorization grant: `show(url, code)` tells the person where to approve."""
    response = _post(connection, "auth/device", {})
    if response.status_code != 200:
        raise _refused(response)
    grant = response.json()
    link, code = str(grant.get("verification_uri_complete") or grant["verification_uri"]), str(grant["user_code"])
    if not (link.startswith(f"{connection.issuer}/") and PRINTABLE.fullmatch(link) and DEVICE_CODE.fullmatch(code)):
        raise LoginError(f"the device login's link or code is not the realm's ({link[:200]!r}): not shown",
                         hint="the gateway or Keycloak answering is not the appliance's")
    show(link, code)
    try:
        interval = min(max(float(grant.get("interval", 5)), 1.0), 60.0)
        deadline = time.monotonic() + min(float(grant.get("expires_in", 600)), 3600.0)
    except ValueError as exc:
        raise LoginError(f"Keycloak's device grant is malformed ({exc})") from exc
    if interval != interval or deadline != deadline:  # NaN
        raise LoginError("Keycloak's device grant is malformed (NaN)")
    while time.monotonic() < deadline:
        time.sleep(interval)
        response = _post(connection, "token", {"grant_type": "urn:ietf:params:oauth:grant-type:device_code",
                                               "device_code": grant["device_code"]})
        if response.status_code == 200:
            body = response.json()
            token = CachedToken.from_response(_username(body["access_token"]), body)
            save(connection, token)
            return token
        error = response.json().get("error") if response.headers.get("content-type", "").startswith(
            "application/json") else None
        # A 429 is the gateway's per-source login throttle (many people behind one address): wait
        # longer, as Keycloak's slow_down asks, rather than fail a login that is being approved.
        if error == "slow_down" or response.status_code == 429:
            interval = min(interval + 5, 60.0)
        elif error != "authorization_pending":
            raise _refused(response)
    raise LoginError("the device code expired before it was approved", hint="run `appliance token` again")


def _username(access_token: str) -> str:
    claims = token_claims(access_token)
    return str(claims.get("preferred_username") or claims.get("sub"))


def token_claims(access_token: str) -> dict[str, Any]:
    """An access token's claims, decoded here without checking its signature: it is only read to
    tell who the CLI's own login is (the gateway checks every token it is sent)."""
    parts = access_token.split(".")
    if len(parts) != 3:
        raise LoginError(f"the access token is not a JWT: {len(parts)} dot-separated parts, not 3")
    try:
        claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    except ValueError as exc:  # bad base64, bad UTF-8 and bad JSON alike
        raise LoginError(f"the access token's claims cannot be decoded: {exc}") from exc
    if not isinstance(claims, dict):
        raise LoginError(f"the access token's claims are a JSON {type(claims).__name__}, not an object")
    return claims


def realm_roles(claims: dict[str, Any]) -> list[str]:
    """The realm roles a token carries (what the gateway authorises by), sorted."""
    access = claims.get("realm_access")
    roles = access.get("roles") if isinstance(access, dict) else None
    return sorted(map(str, roles)) if isinstance(roles, list) else []


def cached_login(connection: Connection) -> CachedToken:
    """The cached login as stored, not refreshed. LoginError when there is none or it cannot be read."""
    path = connection.token_cache
    try:
        raw = path.read_text()
    except FileNotFoundError as exc:
        raise LoginError("not logged in", hint="run `appliance token` first") from exc
    except OSError as exc:
        raise LoginError(f"not logged in: cannot read {path}: {exc.strerror}") from exc
    try:
        return _checked(CachedToken(**json.loads(raw)))
    except (ValueError, TypeError) as exc:
        raise LoginError(f"not logged in: {path} is not a cached login ({exc})",
                         hint="log in again: `appliance token`") from exc


@dataclass(frozen=True)
class LocalLogin:
    """Who the CLI's cached login is, as its token's claims say."""

    username: str
    subject: str


def local_login(connection: Connection, now: float) -> LocalLogin | None:
    """The person logged in at this CLI to `connection`'s realm, to record what they change on the
    host: the cached login, not refreshed (no network), while it is valid (its access or refresh
    token unexpired), if its token's claims are of this realm and client (`iss`, `azp`) and name a
    user and a subject. None otherwise. Its signature is not checked: the CLI holds no realm key
    offline (the record names the OS user too)."""
    try:
        cached = cached_login(connection)
        claims = token_claims(cached.access_token)
    except (ApplianceError, OSError):  # no login, or a login cache this user cannot use
        return None
    username, subject = claims.get("preferred_username"), claims.get("sub")
    if (max(cached.expires_at, cached.refresh_expires_at) <= now or claims.get("iss") != connection.issuer
            or claims.get("azp") != connection.client_id or not isinstance(username, str) or not username
            or not isinstance(subject, str) or not subject):
        return None
    return LocalLogin(username=username, subject=subject)


def _checked(token: CachedToken) -> CachedToken:
    """TypeError naming the first field of the wrong type (a cache edited or cut short by hand)."""
    for name, kind in (("username", str), ("access_token", str), ("refresh_token", str),
                       ("expires_at", (int, float)), ("refresh_expires_at", (int, float))):
        if not isinstance(getattr(token, name), kind) or isinstance(getattr(token, name), bool):
            raise TypeError(f"{name} is {type(getattr(token, name)).__name__}")
    return token


def current_token(connection: Connection) -> CachedToken:
    """The cached token, refreshed (and cached again) if it is about to expire."""
    cached = cached_login(connection)
    token = refreshed(connection, cached, "the cached login", "run `appliance token` again")
    if token is not cached:
        save(connection, token)
    return token


def refreshed(connection: Connection, token: CachedToken, whose: str, again: str) -> CachedToken:
    """`token` while it is not about to expire, else a new one from its refresh token (not cached).
    LoginError saying that `whose` login ended and `again` (how to log in again) when it cannot be."""
    now = time.time()
    if token.expires_at - now > MARGIN_S:
        return token
    if not token.refresh_token or token.refresh_expires_at <= now:
        raise LoginError(f"{whose} has expired", hint=again)
    response = _post(connection, "token", {"grant_type": "refresh_token", "refresh_token": token.refresh_token})
    if response.status_code != 200:
        refused = _refused(response)
        raise LoginError(f"{whose} has ended: {refused.message}", hint=again)
    return CachedToken.from_response(token.username, response.json())


class Session:
    """A login a long-running program (the TUI) holds for itself: taken from the cache at its first
    use, then refreshed in memory and never written back, so a later `appliance token` for another
    user does not change whose requests it sends. Only `adopt` (a login made in the program) does.
    `again` says how to log in again once it ends. Safe to use from several threads."""

    def __init__(self, connection: Connection, again: str) -> None:
        self.connection = connection
        self.again = again
        self._token: CachedToken | None = None
        self._lock = threading.Lock()

    def token(self) -> CachedToken:
        """The held token, refreshed near its expiry. LoginError once it can no longer be."""
        with self._lock:
            if self._token is None:
                try:
                    self._token = current_token(self.connection)
                except KeycloakUnreachable:
                    raise
                except LoginError as exc:
                    exc.hint = self.again
                    raise
                return self._token
            self._token = refreshed(self.connection, self._token, f"the login as {self._token.username}",
                                    self.again)
            return self._token

    def adopt(self, token: CachedToken) -> None:
        """Hold `token` from now on (a login made in the program itself)."""
        with self._lock:
            self._token = token
