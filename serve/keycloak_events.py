"""Keycloak's failed logins, lockouts and admin changes, copied into the audit log.

Keycloak keeps them in its event store (installer.realm turns the store on for EVENT_ACTIONS' types
and for admin events, without their details). Every `keycloak.events_poll_s` the gateway reads the
new ones through the admin API as its service account (realm-management `view-events`) and writes
them with its own audit writer, so the log keeps one writer and one chain:

    keycloak.login_error         a wrong password, an unknown, disabled or locked-out user (`error` says which)
    keycloak.client_login_error  a client that failed to authenticate (a wrong client secret)
    keycloak.lockout             brute-force detection locked an account
    keycloak.admin.<operation>   an admin changed the realm: create, update, delete or action

each with the user (`subject`: Keycloak's user id, as in the gateway's own records; `username`) and
the source address Keycloak saw. Failed logins are refusals and are summarised as the gateway's are
(serve.summaries, over audit.refusal_interval_s): the first per source, action and user in an
interval has its own record, the rest one record with a `count`; unknown usernames count as one
user, so a guessing script cannot flood the log, whatever names it tries.

Where the copy got to is a cursor per stream (the time of the last event handled and the ids of
those handled at that millisecond), saved durably after each record: after a restart the gateway
goes on from there and loses nothing (a record written just before a crash, whose cursor was not,
is written again; its request_id, "keycloak:<event id>", tells). As with the gateway's refusals, a
gateway that dies loses the counts of the current interval. Only events older than SETTLE_MS are
read, so one whose transaction commits late still comes after the cursor.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx

from appliance.changes import Target
from appliance.durable import replace_file
from appliance.home import Home
from appliance.secrets import gateway_client_secret
from appliance.settings import Settings
from audit import AuditEvent, AuditWriter
from serve.summaries import Summaries, cap_text

log = logging.getLogger("appliance.gateway")

# Keycloak's event types the audit log takes, and their actions.
EVENT_ACTIONS = {
    "LOGIN_ERROR": "keycloak.login_error",
    "CLIENT_LOGIN_ERROR": "keycloak.client_login_error",
    "USER_DISABLED_BY_TEMPORARY_LOCKOUT": "keycloak.lockout",
    "USER_DISABLED_BY_PERMANENT_LOCKOUT": "keycloak.lockout",
}
STREAMS = ("events", "admin-events")
PAGE = 200
PAGES_PER_POLL = 25  # a backlog is caught up over several polls, each bounded
SETTLE_MS = 2000
TOKEN_MARGIN_S = 30.0
USERNAMES_CACHED = 4096
UNKNOWN_USER = "?"


def cursor_file(home: Home) -> Path:
    """Beside Keycloak's own data (embedded), whose event store it follows."""
    return home.root / "keycloak" / "events-cursor.json"


@dataclass
class Cursor:
    """The last event of a stream already handled: its time, and the ids handled at that millisecond."""

    time_ms: int = 0
    ids: list[str] = field(default_factory=list)

    def is_new(self, event: dict[str, Any]) -> bool:
        at = int(event.get("time", 0))
        return at > self.time_ms or (at == self.time_ms and str(event.get("id")) not in self.ids)

    def advance(self, event: dict[str, Any]) -> None:
        at = int(event.get("time", 0))
        if at != self.time_ms:
            self.time_ms, self.ids = at, []
        self.ids.append(str(event.get("id")))


def load_cursors(path: Path) -> dict[str, Cursor]:
    """The saved cursors; fresh ones (from the store's beginning) where none is saved. A file that
    cannot be read stops the import (fail closed: starting over would write every event again)."""
    if not path.exists():
        return {stream: Cursor() for stream in STREAMS}
    saved = json.loads(path.read_text())
    return {stream: Cursor(int(saved[stream]["time_ms"]), [str(i) for i in saved[stream]["ids"]])
            for stream in STREAMS}


def save_cursors(path: Path, cursors: dict[str, Cursor]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {stream: {"time_ms": c.time_ms, "ids": c.ids} for stream, c in cursors.items()}
    replace_file(path, json.dumps(data).encode())


def login_record(event: dict[str, Any], username: str | None) -> AuditEvent | None:
    """The record of a failed login, a client's failed authentication or a lockout (None for a
    type the log does not take). A name Keycloak knows no user by goes in `error`, not `username`:
    the record must not attribute a guess to someone."""
    action = EVENT_ACTIONS.get(str(event.get("type")))
    if action is None:
        return None
    details = event.get("details") or {}
    user_id = event.get("userId")
    error = str(event.get("error") or "")
    if action == "keycloak.lockout":
        permanent = event.get("type") == "USER_DISABLED_BY_PERMANENT_LOCKOUT"
        detail = "permanent lockout" if permanent else f"locked until {details.get('not_before', '?')}"
        error = f"{details.get('num_failures', '?')} failed logins: {details.get('reason', 'brute force')}"
        status = 423
    else:
        detail = str(details.get("grant_type") or details.get("auth_method") or "login")
        if user_id:
            username = username or details.get("username")
        elif details.get("username"):
            error = f"{error}: {details['username']}"
        status = 401
    return AuditEvent(request_id=f"keycloak:{event.get('id')}", action=action, outcome="denied", status=status,
                      subject=user_id, username=_capped(username), client=_capped(event.get("clientId")),
                      source=_capped(event.get("ipAddress")), resource="keycloak",
                      target=Target(kind="user", name=cap_text(username)) if username else None,
                      detail=cap_text(detail), reason=_capped(event.get("error")) or "lockout",
                      error=cap_text(error) if error else None)


def admin_record(event: dict[str, Any], username: str | None) -> AuditEvent:
    """The record of an admin's change to the realm (Keycloak keeps only those that succeeded,
    unless it says otherwise in `error`)."""
    auth = event.get("authDetails") or {}
    operation = str(event.get("operationType") or "unknown").lower()
    error = event.get("error")
    return AuditEvent(request_id=f"keycloak:{event.get('id')}", action=cap_text(f"keycloak.admin.{operation}"),
                      outcome="error" if error else "allowed", status=400 if error else 200,
                      subject=_capped(auth.get("userId")), username=_capped(username),
                      source=_capped(auth.get("ipAddress")), resource="keycloak",
                      target=Target(kind=cap_text(str(event.get("resourceType", "?")).lower(), 64),
                                    name=cap_text(str(event.get("resourcePath", "")))),
                      reason=cap_text(str(error), 64) if error else None,
                      error=cap_text(str(error)) if error else None)


def _capped(value: object) -> str | None:
    return cap_text(str(value)) if value else None


def summary_kind(record: AuditEvent) -> str:
    """Failed logins are counted together per source (the summaries' party), action and user."""
    return f"{record.action}:{record.subject or UNKNOWN_USER}"


class KeycloakEvents:
    """Copies new events from Keycloak's event store into the audit log, one poll at a time."""

    def __init__(self, settings: Settings, home: Home, writer: AuditWriter, http: httpx.AsyncClient,
                 summaries: Summaries) -> None:
        keycloak = settings.keycloak
        self._interval = keycloak.events_poll_s
        self._token_url = f"{keycloak.realm_url}/protocol/openid-connect/token"
        self._admin_url = f"{keycloak.base_url}/admin/realms/{keycloak.realm}"
        self._credentials = (keycloak.gateway_client_id, gateway_client_secret(settings, home))
        self._writer = writer
        self._http = http
        self._summaries = summaries
        self._path = cursor_file(home)
        self._cursors: dict[str, Cursor] | None = None
        self._token: tuple[str, float] | None = None
        self._usernames: dict[str, str | None] = {}
        self._reported: str | None = None

    async def run(self) -> None:
        """Poll until cancelled; a failed poll is logged (once per kind of failure) and retried."""
        while True:
            try:
                await self.poll()
                self._reported = None
            except Exception as exc:  # Keycloak down or odd, the log unwritable: never the gateway's end
                self._report(exc)
            await anyio.sleep(self._interval)

    def _report(self, exc: Exception) -> None:
        reason = f"{type(exc).__name__}: {exc}"
        if reason != self._reported:
            self._reported = reason
            hint = " (does the gateway's service account have realm-management view-events?)" \
                if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code == 403 else ""
            log.warning("Keycloak events not copied into the audit log: %s%s", reason, hint)

    async def poll(self) -> None:
        """Copy every event settled since the cursors, a bounded number of pages per stream."""
        if self._cursors is None:
            self._cursors = await anyio.to_thread.run_sync(load_cursors, self._path)
        until = int(time.time() * 1000) - SETTLE_MS
        for stream in STREAMS:
            await self._copy(stream, self._cursors[stream], until)

    async def _copy(self, stream: str, cursor: Cursor, until: int) -> None:
        """The cursor is saved after each record written (never written twice) and after each
        page (events only counted into a summary are then not read again)."""
        since = cursor.time_ms
        for page in range(PAGES_PER_POLL):
            events = await self._page(stream, since, until, page * PAGE)
            fresh = [event for event in events if cursor.is_new(event)]
            for event in fresh:
                written = await self._record(stream, event)
                cursor.advance(event)
                if written:
                    await self._save()
            if fresh:
                await self._save()
            if len(events) < PAGE:
                return

    async def _save(self) -> None:
        await anyio.to_thread.run_sync(save_cursors, self._path, self._cursors or {})

    async def _page(self, stream: str, since: int, until: int, first: int) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"dateFrom": since, "dateTo": until, "direction": "asc", "first": first, "max": PAGE}
        if stream == "events":
            params["type"] = list(EVENT_ACTIONS)
        response = await self._http.get(f"{self._admin_url}/{stream}", params=params,
                                         headers=await self._authorization())
        response.raise_for_status()
        events = response.json()
        if not isinstance(events, list) or not all(isinstance(event, dict) for event in events):
            raise ValueError(f"Keycloak's {stream} are not a list of events")
        return events

    async def _record(self, stream: str, event: dict[str, Any]) -> bool:
        """Write the event's record now (True), or count it into its interval's summary."""
        if stream == "admin-events":
            user_id = (event.get("authDetails") or {}).get("userId")
            return await self._append(admin_record(event, await self._username(user_id)))
        # A lockout event names only the user's id; a failed login names the user too.
        locked = EVENT_ACTIONS.get(str(event.get("type"))) == "keycloak.lockout"
        record = login_record(event, await self._username(event.get("userId")) if locked else None)
        if record is None:
            return False
        if locked or self._summaries.first_of_interval(record, summary_kind(record)):
            return await self._append(record)
        return False

    async def _append(self, record: AuditEvent) -> bool:
        await anyio.to_thread.run_sync(self._writer.append, record)
        return True

    async def _username(self, user_id: object) -> str | None:
        """The username of a user of the realm by id (None for none, or one of another realm:
        the master realm's admin)."""
        if not user_id:
            return None
        key = str(user_id)
        if key not in self._usernames:
            response = await self._http.get(f"{self._admin_url}/users/{key}", headers=await self._authorization())
            if response.status_code not in (200, 404):
                response.raise_for_status()
            if len(self._usernames) >= USERNAMES_CACHED:
                self._usernames.clear()
            user = response.json() if response.status_code == 200 else {}
            self._usernames[key] = str(user["username"]) if isinstance(user, dict) and user.get("username") else None
        return self._usernames[key]

    async def _authorization(self) -> dict[str, str]:
        """A bearer header of the gateway's service account (client credentials), renewed before it ends."""
        now = time.monotonic()
        if self._token is None or self._token[1] <= now:
            response = await self._http.post(self._token_url, data={"grant_type": "client_credentials"},
                                             auth=self._credentials)
            response.raise_for_status()
            body = response.json()
            self._token = (str(body["access_token"]), now + float(body.get("expires_in", 60)) - TOKEN_MARGIN_S)
        return {"Authorization": f"Bearer {self._token[0]}"}
