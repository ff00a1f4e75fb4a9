"""Keycloak's failed logins, lockouts and admin events become audit records attributed to the user
and source; guessing is summarised, not flooded; the cursor survives a restart and writes nothing twice."""

from __future__ import annotations

import json
import time
from typing import Any

import anyio
import httpx
import pytest

from appliance.home import Home
from appliance.settings import KeycloakSettings, Settings
from audit import AuditWriter, signing_key, verification_key, verify
from audit.reader import read_records
from serve.keycloak_events import (
    SETTLE_MS,
    Cursor,
    KeycloakEvents,
    admin_record,
    cursor_file,
    load_cursors,
    login_record,
    summary_kind,
)
from serve.summaries import Summaries

USER_ID = "a7ab1cd6-aa5c-43db-8d64-e518262c09cb"


def failed_login(event_id: str, at: int, *, user_id: str | None = USER_ID, username: str = "lockee",
                 ip: str = "10.0.0.7", error: str = "invalid_user_credentials") -> dict[str, Any]:
    return {"id": event_id, "time": at, "type": "LOGIN_ERROR", "clientId": "appliance-cli", "userId": user_id,
            "ipAddress": ip, "error": error,
            "details": {"auth_method": "openid-connect", "grant_type": "password", "username": username}}


def lockout(event_id: str, at: int) -> dict[str, Any]:
    return {"id": event_id, "time": at, "type": "USER_DISABLED_BY_TEMPORARY_LOCKOUT", "userId": USER_ID,
            "ipAddress": "10.0.0.7", "details": {"reason": "brute_force_attack detected",
                                                 "not_before": "2026-12-02T05:37:44", "num_failures": "3"}}


def admin_event(event_id: str, at: int) -> dict[str, Any]:
    return {"id": event_id, "time": at, "authDetails": {"userId": "admin-id", "ipAddress": "127.0.0.1"},
            "operationType": "CREATE", "resourceType": "USER", "resourcePath": "users/u-1"}


def test_a_failed_login_names_user_source_client_and_why() -> None:
    record = login_record(failed_login("e1", 1), None)
    assert record is not None
    assert (record.action, record.outcome, record.status) == ("keycloak.login_error", "denied", 401)
    assert (record.subject, record.username, record.source) == (USER_ID, "lockee", "10.0.0.7")
    assert (record.client, record.resource, record.detail) == ("appliance-cli", "keycloak", "password")
    assert record.reason == record.error == "invalid_user_credentials"
    assert record.target is not None and (record.target.kind, record.target.name) == ("user", "lockee")
    assert record.request_id == "keycloak:e1"


def test_a_guessed_username_is_no_ones_and_is_counted_as_one_user() -> None:
    record = login_record(failed_login("e1", 1, user_id=None, username="root", error="user_not_found"), None)
    assert record is not None and record.subject is None and record.username is None
    assert record.error == "user_not_found: root"
    other = login_record(failed_login("e2", 1, user_id=None, username="oracle", error="user_not_found"), None)
    assert other is not None and summary_kind(record) == summary_kind(other)


def test_a_lockout_and_an_admin_change_are_attributed() -> None:
    locked = login_record(lockout("e3", 1), "lockee")
    assert locked is not None
    assert (locked.action, locked.status, locked.subject, locked.username) == ("keycloak.lockout", 423, USER_ID,
                                                                              "lockee")
    assert locked.detail == "locked until 2026-12-02T05:37:44" and locked.error is not None
    assert locked.resource == "keycloak" and locked.target is not None and locked.target.name == "lockee"
    assert "3 failed logins" in locked.error
    changed = admin_record(admin_event("a1", 1), "kcadmin")
    assert (changed.action, changed.outcome, changed.subject, changed.username, changed.source) == (
        "keycloak.admin.create", "allowed", "admin-id", "kcadmin", "127.0.0.1")
    assert changed.resource == "keycloak" and changed.target is not None
    assert (changed.target.kind, changed.target.name) == ("user", "users/u-1")
    assert login_record({"id": "x", "time": 1, "type": "LOGIN"}, None) is None


def test_the_cursor_skips_what_it_handled_at_the_same_millisecond() -> None:
    cursor = Cursor()
    first, twin, later = failed_login("a", 5), failed_login("b", 5), failed_login("c", 6)
    cursor.advance(first)
    assert not cursor.is_new(first) and cursor.is_new(twin) and cursor.is_new(later)
    cursor.advance(twin)
    assert cursor.ids == ["a", "b"]
    cursor.advance(later)
    assert (cursor.time_ms, cursor.ids) == (6, ["c"])


class FakeKeycloak:
    """Keycloak's token, events, admin-events and users endpoints, answering from lists."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.admin_events: list[dict[str, Any]] = []
        self.queries: list[httpx.QueryParams] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path.endswith("/token"):
            return httpx.Response(200, json={"access_token": "t", "expires_in": 300})
        if path.endswith(f"/users/{USER_ID}"):
            return httpx.Response(200, json={"id": USER_ID, "username": "lockee"})
        if "/users/" in path:
            return httpx.Response(404, json={"error": "User not found"})
        assert request.headers["Authorization"] == "Bearer t"
        params = request.url.params
        self.queries.append(params)
        stored = self.events if path.endswith("/events") else self.admin_events
        chosen = [e for e in stored if int(params["dateFrom"]) <= e["time"] <= int(params["dateTo"])]
        if path.endswith("/events"):
            chosen = [e for e in chosen if e["type"] in params.get_list("type")]
        first, most = int(params["first"]), int(params["max"])
        return httpx.Response(200, json=sorted(chosen, key=lambda e: e["time"])[first:first + most])


def poll(home: Home, keycloak: FakeKeycloak, summaries: Summaries) -> None:
    settings = Settings(keycloak=KeycloakSettings(gateway_client_secret="s"))
    writer = AuditWriter(home.audit, signing_key(home))

    async def once() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(keycloak.handle)) as http:
            await KeycloakEvents(settings, home, writer, http, summaries).poll()

    try:
        anyio.run(once)
    finally:
        writer.close()


def records(home: Home) -> list[dict[str, Any]]:
    return list(read_records(home.audit))


def test_events_are_copied_once_across_restarts_and_guessing_is_summarised(home: Home) -> None:
    keycloak = FakeKeycloak()
    settled = 1_000_000
    keycloak.events = [failed_login(f"f{i}", settled + i // 2) for i in range(60)] + [lockout("l1", settled + 40)]
    keycloak.admin_events = [admin_event("a1", settled)]
    summaries = Summaries(3600, 16, party_field="source", summary_action=None)
    poll(home, keycloak, summaries)
    written = records(home)
    assert [r["action"] for r in written] == ["keycloak.login_error", "keycloak.lockout", "keycloak.admin.create"]
    assert written[1]["username"] == "lockee" and written[2]["username"] is None  # an admin of another realm
    [summary] = summaries.due(all_now=True)
    assert summary.count == 59 and summary.source == "10.0.0.7" and summary.username == "lockee"

    keycloak.events.append(failed_login("late", settled + 100, ip="10.0.0.8"))
    poll(home, keycloak, Summaries(3600, 16, party_field="source", summary_action=None))  # a restarted gateway
    again = records(home)
    assert [r["request_id"] for r in again[3:]] == ["keycloak:late"], "nothing twice, nothing lost"
    saved = json.loads(cursor_file(home).read_text())
    assert saved["events"] == {"time_ms": settled + 100, "ids": ["late"]}
    assert verify(home.audit, verification_key(home)).records == 4


def test_only_settled_events_are_read_and_a_bad_cursor_stops_the_copy(home: Home) -> None:
    keycloak = FakeKeycloak()
    poll(home, keycloak, Summaries(60, 16, party_field="source", summary_action=None))
    date_to = int(keycloak.queries[0]["dateTo"])
    assert keycloak.queries[0]["direction"] == "asc"
    assert date_to <= time.time() * 1000 - SETTLE_MS
    assert not cursor_file(home).exists(), "nothing copied, nothing saved"
    cursor_file(home).parent.mkdir()
    cursor_file(home).write_text("{")
    with pytest.raises(ValueError):
        load_cursors(cursor_file(home))
