"""The gateway's audit middleware: where it writes a record (on the event loop for a lone
request, in a worker thread while other requests are in flight or the disk is slow), that a
response or a stream's end marker waits for its record, and that requests which never complete
(the client left mid-stream, the server failed) are recorded too."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from starlette.requests import Request

from audit import AuditEvent, AuditRecord, AuditUnavailable, AuditWriter, read_records
from serve.audit_trail import (
    INLINE_FLUSH_LIMIT_S,
    MONITORING,
    REFRESHED,
    AuditMiddleware,
    Transcript,
    note_target,
)
from serve.auth import Principal
from serve.context import context_of
from serve.summaries import Refusals, Summaries


class Recorded(AuditWriter):
    """A real writer that notes which thread appended each record, and whose flushes take as
    long as the test says (not as long as this machine's disk happens to take)."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory, Ed25519PrivateKey.generate())
        self.threads: dict[str, int] = {}
        self.flush_s = 0.0

    @property
    def last_flush_s(self) -> float:
        return self.flush_s

    @last_flush_s.setter
    def last_flush_s(self, measured: float) -> None:
        pass

    def append(self, event: AuditEvent) -> AuditRecord:
        self.threads[event.resource or ""] = threading.get_ident()
        return super().append(event)


def middleware(writer: AuditWriter, gates: dict[str, asyncio.Event]) -> AuditMiddleware:
    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["path"] in gates:
            await gates[scope["path"]].wait()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}"})

    return audit_middleware(app, writer)


def audit_middleware(app: Any, writer: AuditWriter) -> AuditMiddleware:
    return AuditMiddleware(app, writer=writer, hasher=lambda text: None, capture_text=False,
                           refusals=Refusals(interval_s=10, max_sources=4),
                           monitoring=Summaries(300, 4, party_field="subject", summary_action=None))


ROUTE_NAMES = {"/v1/chat/completions": "chat.completions"}  # as the gateway declares it


async def request(audited: AuditMiddleware, path: str, on_send: Any = None, method: str = "POST",
                  route_extra: dict | None = None, query: bytes = b"", route_name: str | None = None,
                  path_params: dict | None = None) -> list[dict]:
    """`method path` through the middleware; the messages the client was sent."""
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    async def send(message: dict) -> None:
        if on_send is not None:
            on_send(message)
        sent.append(message)

    # As the router leaves it: the matched route names the action.
    name = route_name or ROUTE_NAMES.get(path, "test" + path.replace("/", "."))
    await audited({"type": "http", "method": method, "path": path, "headers": [], "client": ("127.0.0.1", 1),
                   "query_string": query, "path_params": path_params or {},
                   "route": SimpleNamespace(path=path, name=name, openapi_extra=route_extra)}, receive, send)
    return sent


def test_a_lone_request_writes_on_the_loop_and_concurrent_ones_in_a_thread(tmp_path: Path) -> None:
    writer = Recorded(tmp_path)
    gate = asyncio.Event()
    audited = middleware(writer, {"/v1/slow": gate})

    async def scenario() -> int:
        await request(audited, "/v1/alone")
        slow = asyncio.create_task(request(audited, "/v1/slow"))
        await asyncio.sleep(0)  # /v1/slow is now in flight, waiting
        await request(audited, "/v1/beside")
        gate.set()
        await slow
        return threading.get_ident()

    loop_thread = asyncio.run(scenario())
    assert writer.threads["/v1/alone"] == loop_thread
    assert writer.threads["/v1/beside"] != loop_thread, "another request was in flight"
    assert writer.threads["/v1/slow"] == loop_thread, "alone again by the time it finished"
    assert writer.head[0] == 3 and audited.in_flight == 0


def test_a_slow_disk_sends_records_to_a_thread_and_the_response_still_waits(tmp_path: Path) -> None:
    writer = Recorded(tmp_path)
    audited = middleware(writer, {})

    async def scenario() -> tuple[int, list[dict]]:
        writer.flush_s = INLINE_FLUSH_LIMIT_S * 2
        return threading.get_ident(), await request(audited, "/v1/after-a-slow-flush")

    loop_thread, sent = asyncio.run(scenario())
    assert writer.threads["/v1/after-a-slow-flush"] != loop_thread
    assert [message["type"] for message in sent] == ["http.response.start", "http.response.body"]
    assert writer.head[0] == 1


@pytest.mark.parametrize("path", ["/healthz", "/metrics"])
def test_unaudited_paths_leave_no_record(tmp_path: Path, path: str) -> None:
    writer = Recorded(tmp_path)
    sent = asyncio.run(request(middleware(writer, {}), path))
    assert sent[0]["status"] == 200 and writer.threads == {} and writer.head[0] == 0


def streaming_app(*, end: bool = True, fail: bool = False) -> Any:
    """An SSE response of two events and the end marker; or one that stops (the client left),
    or raises (the engine failed) after its first event."""

    async def app(scope: dict, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        if fail:
            raise RuntimeError("engine went away")
        if not end:
            return  # as Starlette's StreamingResponse does when the client disconnects
        context_of(Request(scope)).transcript = transcript = Transcript()
        transcript.end()  # as the relay does once it has parsed the end marker's line
        await send({"type": "http.response.body", "body": b"data: {}\n\ndata: [DONE]\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def test_a_streams_end_marker_waits_for_its_record(tmp_path: Path) -> None:
    writer = Recorded(tmp_path)
    on_disk_when_sent: list[int] = []
    audited = audit_middleware(streaming_app(), writer)

    def on_send(message: dict) -> None:
        if b"[DONE]" in message.get("body", b""):
            on_disk_when_sent.append(len(list(read_records(tmp_path))))

    asyncio.run(request(audited, "/v1/chat/completions", on_send))
    assert on_disk_when_sent == [1] and writer.head[0] == 1, "one record, on disk before [DONE] went out"


def test_an_unwritable_log_cuts_a_stream_before_its_end_marker(tmp_path: Path) -> None:
    writer = Recorded(tmp_path)
    sent: list[dict] = []
    audited = audit_middleware(streaming_app(), writer)

    def refuse(event: AuditEvent) -> AuditRecord:
        raise AuditUnavailable("disk full")

    writer.append = refuse  # type: ignore[method-assign]
    with pytest.raises(AuditUnavailable):
        asyncio.run(request(audited, "/v1/chat/completions", sent.append))
    assert not any(b"[DONE]" in message.get("body", b"") for message in sent)


@pytest.mark.parametrize(("app", "status"), [(streaming_app(end=False), 499), (streaming_app(fail=True), 500)])
def test_requests_that_never_complete_are_recorded(tmp_path: Path, app: Any, status: int) -> None:
    writer = Recorded(tmp_path)
    audited = audit_middleware(app, writer)

    try:
        asyncio.run(request(audited, "/v1/chat/completions"))
    except RuntimeError:
        assert status == 500, "the server's failure goes on to the server, recorded"
    [record] = read_records(tmp_path)
    assert record["status"] == status and record["action"] == "chat.completions"
    expected = ("invalid", "client_gone") if status == 499 else ("error", "http_500")
    assert (record["outcome"], record["reason"]) == expected
    assert audited.in_flight == 0


def test_a_record_that_cannot_be_built_withholds_the_answer_and_records_the_failure(tmp_path: Path) -> None:
    """Regression: an exception while building a record let the answer out with no record."""
    writer = Recorded(tmp_path)
    audited = middleware(writer, {})

    def broken(text: str | None) -> str | None:
        raise RuntimeError("hasher broke")

    audited.hasher = broken
    sent = asyncio.run(request(audited, "/v1/chat/completions"))
    assert sent[0]["status"] == 500 and b"audit_record_failed" in sent[1]["body"]
    [record] = read_records(tmp_path)
    assert (record["action"], record["status"], record["outcome"]) == ("audit.record_failed", 500, "error")
    assert "RuntimeError: hasher broke" in record["error"]


def test_a_record_that_cannot_be_built_cuts_a_stream_before_its_end(tmp_path: Path) -> None:
    writer = Recorded(tmp_path)
    sent: list[dict] = []
    audited = audit_middleware(streaming_app(), writer)
    audited.hasher = lambda text: 1 / 0  # type: ignore[assignment,return-value]
    with pytest.raises(RuntimeError):
        asyncio.run(request(audited, "/v1/chat/completions", sent.append))
    assert not any(b"[DONE]" in message.get("body", b"") for message in sent)
    assert [r["action"] for r in read_records(tmp_path)] == ["audit.record_failed"]


def test_repeated_refusals_from_one_source_are_summarised_not_written_each(tmp_path: Path) -> None:
    writer = Recorded(tmp_path)

    async def unauthorised(scope: dict, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 401, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    audited = audit_middleware(unauthorised, writer)

    async def flood() -> None:
        for _ in range(50):
            await request(audited, "/v1/" + "x" * 65536)

    asyncio.run(flood())
    [first] = read_records(tmp_path)
    assert first["action"] == "auth.denied" and first["status"] == 401
    [summary] = audited.refusals.due(all_now=True)
    assert summary.count == 49 and summary.source == "127.0.0.1"


def test_an_administrators_refused_changes_each_keep_their_record_and_object(tmp_path: Path) -> None:
    """Refused for what they asked (409, 400, 404), a signed-in user's writes to the admin API are
    recorded one by one with their objects; refused for who asked (403) they are summarised."""
    writer = Recorded(tmp_path)
    status = [409]

    async def refusing(scope: dict, receive: Any, send: Any) -> None:
        context_of(Request(scope)).principal = Principal(subject="s-1", username="alice", client="appliance-cli",
                                                         roles=frozenset({"admin"}), token_id="t", expires_at=0.0)
        note_target(Request(scope), "adapter", scope["path"].rsplit("/", 1)[-1])
        await answering(status[0], b"{}")(scope, receive, send)

    audited = audit_middleware(refusing, writer)

    async def attempts() -> None:
        for status[0] in (409, 400, 404, 403):
            for name in ("a", "b", "c"):
                await request(audited, f"/admin/adapters/{name}", route_name="adapters.deploy",
                              path_params={"name": name})

    asyncio.run(attempts())
    records = list(read_records(tmp_path))
    kept = [(r["status"], r["target"]["name"]) for r in records if r["status"] in (400, 404, 409)]
    assert kept == [(code, name) for code in (409, 400, 404) for name in ("a", "b", "c")]
    assert [r["target"]["name"] for r in records if r["status"] == 403] == ["a"], "who asked: summarised"


def test_repeated_reads_are_counted_and_a_new_query_is_recorded(tmp_path: Path) -> None:
    """A dashboard polling the services, or a screen refreshing the same view of the users or the
    audit log, adds one record per interval; a new query has a record of its own."""
    writer = AuditWriter(tmp_path, Ed25519PrivateKey.generate())
    audited = middleware(writer, {})

    async def polls() -> None:
        for _ in range(5):
            await request(audited, "/admin/services", method="GET", route_extra=MONITORING)
        for _ in range(3):
            await request(audited, "/admin/audit", method="GET", query=b"newest=true&limit=200", route_extra=REFRESHED)
        await request(audited, "/admin/audit", method="GET", query=b"newest=true&limit=200&user=bob",
                      route_extra=REFRESHED)
        for _ in range(2):
            await request(audited, "/admin/users", method="GET", route_extra=REFRESHED)
        await request(audited, "/admin/users", method="POST", route_extra=REFRESHED)
        await request(audited, "/admin/users", method="POST", route_extra=REFRESHED)  # a change is never counted
        for _ in range(2):  # a read no screen refreshes (an RL run's attempts: prompts and code) is each recorded
            await request(audited, "/admin/rl/runs/1/attempts", method="GET")

    asyncio.run(polls())
    written = [(r["action"], r["resource"]) for r in read_records(tmp_path)]
    assert written == [("test.admin.services", "/admin/services"),
                       ("test.admin.audit", "/admin/audit?newest=true&limit=200"),
                       ("test.admin.audit", "/admin/audit?newest=true&limit=200&user=bob"),
                       ("test.admin.users", "/admin/users"),
                       ("test.admin.users", "/admin/users"), ("test.admin.users", "/admin/users"),
                       ("test.admin.rl.runs.1.attempts", "/admin/rl/runs/1/attempts"),
                       ("test.admin.rl.runs.1.attempts", "/admin/rl/runs/1/attempts")]
    summaries = {(s.action, s.count) for s in audited.monitoring.due(all_now=True)}
    assert summaries == {("test.admin.services", 4), ("test.admin.audit", 2), ("test.admin.users", 1)}


def answering(status: int, body: bytes) -> Any:
    async def app(scope: dict, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
    return app


@pytest.mark.parametrize(("status", "body", "outcome", "reason"), [
    (200, b"{}", "allowed", None),
    (401, b'{"error":{"code":"expired","type":"authentication_error"}}', "denied", "expired"),
    (403, b'{"error":{"code":"model_not_allowed"}}', "denied", "model_not_allowed"),
    (429, b'{"error":{"code":"rate_limit_exceeded"}}', "denied", "rate_limit_exceeded"),
    (400, b'{"error":{"code":null,"type":"invalid_request_error"}}', "invalid", "invalid_request_error"),
    (404, b'{"detail":"Not Found"}', "invalid", "http_404"),
    (422, b"not json \xff", "invalid", "http_422"),
    (500, b'{"error":{"code":"internal"}}', "error", "internal"),
    (503, b'{"error":{"code":"engine_unavailable"}}', "error", "engine_unavailable"),
])
def test_outcome_tells_denied_invalid_and_error_apart_and_every_refusal_has_its_reason(
        tmp_path: Path, status: int, body: bytes, outcome: str, reason: str | None) -> None:
    writer = AuditWriter(tmp_path, Ed25519PrivateKey.generate())
    asyncio.run(request(audit_middleware(answering(status, body), writer), "/v1/chat/completions"))
    [record] = read_records(tmp_path)
    assert (record["outcome"], record["reason"]) == (outcome, reason)


@pytest.mark.parametrize(("path", "params", "target"), [
    ("/admin/users/bob/disable", {"username": "bob"}, {"kind": "user", "name": "bob"}),
    ("/admin/adapters/coder/deploy", {"name": "coder"}, {"kind": "adapter", "name": "coder"}),
    ("/admin/jobs/7/cancel", {"job_id": "7"}, {"kind": "job", "name": "7"}),
    ("/v1/batches/batch_1/cancel", {"batch_id": "batch_1"}, {"kind": "batch", "name": "batch_1"}),
    ("/admin/keys/ci/revoke", {"key_name": "ci"}, {"kind": "key", "name": "ci"}),
    ("/admin/services/engine/restart", {"name": "engine", "action": "restart"}, {"kind": "service", "name": "engine"}),
    ("/admin/users", {}, None),
])
def test_the_object_a_path_names_is_the_records_target(tmp_path: Path, path: str, params: dict,
                                                        target: dict | None) -> None:
    writer = AuditWriter(tmp_path, Ed25519PrivateKey.generate())
    name = {"username": "users.disable", "name": "adapters.deploy" if "adapters" in path else "services.restart",
            "job_id": "jobs.cancel", "batch_id": "batches.cancel", "key_name": "keys.revoke"}
    route = name[next(iter(params))] if params else "users.add"
    asyncio.run(request(audit_middleware(answering(200, b"{}"), writer), path, method="POST", route_name=route,
                        path_params=params))
    [record] = read_records(tmp_path)
    got = record["target"] and {k: v for k, v in record["target"].items() if v is not None}
    assert got == target and record["resource"] == path and record["action"] == route


def test_a_route_names_its_object_itself_with_version_and_roles(tmp_path: Path) -> None:
    writer = AuditWriter(tmp_path, Ed25519PrivateKey.generate())

    async def granting(scope: dict, receive: Any, send: Any) -> None:
        note_target(Request(scope), "user", "bob", roles=["trainer"])
        await answering(200, b"{}")(scope, receive, send)

    asyncio.run(request(audit_middleware(granting, writer), "/admin/users/bob/roles", route_name="users.grant_role",
                        path_params={"username": "bob"}))
    [record] = read_records(tmp_path)
    assert record["target"] == {"kind": "user", "name": "bob", "version": None, "roles": ["trainer"]}


def test_every_read_is_recorded_when_repeated_reads_are_not_counted(tmp_path: Path) -> None:
    writer = AuditWriter(tmp_path, Ed25519PrivateKey.generate())
    audited = audit_middleware(answering(200, b"[]"), writer)
    audited.count_repeated_reads = False

    async def polls() -> None:
        for _ in range(3):
            await request(audited, "/admin/audit", method="GET", query=b"newest=true", route_extra=REFRESHED)
        for _ in range(3):
            await request(audited, "/admin/services", method="GET", route_extra=MONITORING)

    asyncio.run(polls())
    assert [r["resource"] for r in read_records(tmp_path)] == ["/admin/audit?newest=true"] * 3 + ["/admin/services"]
