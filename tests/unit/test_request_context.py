"""A request's context (serve.context): opened once, by the outermost middleware, with the id the
client is told; what the handlers fill in is what the audit record says, and a request whose
handler fills in nothing still leaves a correct record."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from starlette.requests import Request

from appliance.api_keys import ApiKey
from audit import AuditEvent, AuditWriter, read_records
from serve.audit_trail import AuditMiddleware, note_target
from serve.auth import Principal
from serve.context import RequestContext, Transcript, context_of, open_context
from serve.metrics import Metrics
from serve.middleware import MeterMiddleware
from serve.summaries import Refusals, Summaries

ALICE = Principal(subject="s-alice", username="alice", client="appliance-cli", roles=frozenset({"user"}),
                  token_id="t1", expires_at=float("inf"))


def gateway_stack(app: Any, writer: AuditWriter, after_record: Any = None) -> tuple[MeterMiddleware, Metrics]:
    """`app` inside the audit middleware inside the meter, as the gateway stacks them."""
    audited = AuditMiddleware(app, writer=writer, hasher=lambda text: None, capture_text=False,
                              refusals=Refusals(interval_s=10, max_sources=4),
                              monitoring=Summaries(300, 4, party_field="subject", summary_action=None),
                              after_record=after_record)
    metrics = Metrics()
    return MeterMiddleware(audited, metrics=metrics), metrics


def answering(status: int, body: bytes, fill: Any = None) -> Any:
    """An app that answers `status` with `body`, after `fill(scope)` if given."""
    async def app(scope: dict, receive: Any, send: Any) -> None:
        if fill is not None:
            fill(scope)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
    return app


def call(app: Any, path: str = "/v1/chat/completions", name: str = "chat.completions",
         path_params: dict | None = None) -> tuple[dict, list[dict]]:
    """POST `path` through `app`; the scope it went with, and what the client was sent."""
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": [], "client": ("10.0.0.7", 1),
             "query_string": b"", "path_params": path_params or {},
             "route": SimpleNamespace(path=path, name=name, openapi_extra=None)}
    asyncio.run(app(scope, receive, send))
    return scope, sent


def test_a_requests_context_is_opened_once_by_the_outermost_middleware(tmp_path: Path) -> None:
    seen: list[RequestContext] = []
    stack, _ = gateway_stack(answering(200, b"{}", lambda scope: seen.append(context_of(Request(scope)))),
                             AuditWriter(tmp_path, Ed25519PrivateKey.generate()))
    scope, sent = call(stack)
    [context] = seen
    assert open_context(scope) is context, "everything after the meter finds the one it opened"
    assert dict(sent[0]["headers"])[b"x-request-id"] == context.request_id.encode()
    [record] = read_records(tmp_path)
    assert record["request_id"] == context.request_id
    _, sent_again = call(stack)
    assert dict(sent_again[0]["headers"])[b"x-request-id"] != context.request_id.encode(), "one per request"


def test_a_handler_that_fills_nothing_still_leaves_a_correct_record(tmp_path: Path) -> None:
    stack, metrics = gateway_stack(answering(200, b"{}"), AuditWriter(tmp_path, Ed25519PrivateKey.generate()))
    _, sent = call(stack)
    [record] = read_records(tmp_path)
    assert record["request_id"] == dict(sent[0]["headers"])[b"x-request-id"].decode()
    assert (record["action"], record["status"], record["outcome"], record["reason"]) == \
        ("chat.completions", 200, "allowed", None)
    assert (record["source"], record["resource"]) == ("10.0.0.7", "/v1/chat/completions")
    assert all(record[field] is None for field in ("subject", "username", "client", "key", "target", "model",
                                                   "tier", "replica", "cache_hit_of", "batch", "sensitive"))
    assert (record["prompt_tokens"], record["completion_tokens"]) == (0, 0)
    assert metrics.requests.labels("/v1/chat/completions", "200", "none")._value.get() == 1


def test_a_refusal_no_handler_filled_in_has_its_reason_from_its_body(tmp_path: Path) -> None:
    body = b'{"error":{"code":"invalid_token","type":"authentication_error"}}'
    stack, _ = gateway_stack(answering(401, body), AuditWriter(tmp_path, Ed25519PrivateKey.generate()))
    call(stack)
    [record] = read_records(tmp_path)
    assert (record["action"], record["outcome"], record["reason"], record["subject"]) == \
        ("auth.denied", "denied", "invalid_token", None)


def test_a_key_is_named_one_way_let_in_or_refused(tmp_path: Path) -> None:
    app = ApiKey(name="alice-app", owner="alice", owner_id="s-alice", created=datetime.now(UTC), created_by="alice",
                 prefix="apk-AbCd", digest="0" * 64)
    tmp = app.model_copy(update={"name": "alice-tmp"})
    body = b'{"error":{"code":"revoked_key","type":"authentication_error"}}'

    def let_in(scope: dict) -> None:
        context_of(Request(scope)).principal = Principal.for_key(app, subject="s-alice", roles=frozenset({"user"}))

    def refused(scope: dict) -> None:
        context_of(Request(scope)).refused_key = tmp

    writer = AuditWriter(tmp_path, Ed25519PrivateKey.generate())
    call(gateway_stack(answering(200, b"{}", let_in), writer)[0])
    call(gateway_stack(answering(401, body, refused), writer)[0])
    allowed, denied = read_records(tmp_path)
    assert (allowed["client"], allowed["key"], allowed["username"]) == ("key:alice-app", "alice-app", "alice")
    assert (denied["client"], denied["key"], denied["username"]) == ("key:alice-tmp", "alice-tmp", "alice")
    assert denied["outcome"] == "denied"


def test_what_the_handlers_fill_in_is_what_the_record_says(tmp_path: Path) -> None:
    told: list[tuple[RequestContext, int, AuditEvent]] = []

    def fill(scope: dict) -> None:
        request = Request(scope)
        context = context_of(request)
        context.principal = ALICE
        context.batch = "batch_1:3"
        context.transcript = Transcript(model="demo", prompt_tokens=5, completion_tokens=2, tier="fast",
                                        replica="main-0", batch="batch_1:3")
        note_target(request, "adapter", "coder", version=2)

    stack, metrics = gateway_stack(answering(200, b"{}", fill), AuditWriter(tmp_path, Ed25519PrivateKey.generate()),
                                   after_record=lambda *args: told.append(args))
    scope, _ = call(stack)
    [record] = read_records(tmp_path)
    assert (record["subject"], record["username"], record["client"]) == ("s-alice", "alice", "appliance-cli")
    assert (record["model"], record["prompt_tokens"], record["completion_tokens"]) == ("demo", 5, 2)
    assert (record["tier"], record["replica"], record["batch"]) == ("fast", "main-0", "batch_1:3")
    assert record["target"] == {"kind": "adapter", "name": "coder", "version": 2, "roles": None}
    assert metrics.requests.labels("/v1/chat/completions", "200", "user")._value.get() == 1, "labelled by role"
    [(context, seq, event)] = told
    assert context is open_context(scope) and seq == record["seq"] and event.status == 200


def test_only_the_request_id_is_fixed() -> None:
    context = RequestContext(request_id="r1")
    with pytest.raises(dataclasses.FrozenInstanceError):
        context.request_id = "r2"
    context.principal = ALICE  # filled in as the request passes
    assert (context.request_id, context.principal, context.transcript) == ("r1", ALICE, None)
