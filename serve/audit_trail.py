"""Every /v1 and /admin request, allowed or denied, leaves a durable audit record before its
response is complete (one that never completes too: status 499 when the client went away
mid-stream, 500 when the server failed); if the log cannot be written the gateway fails closed
(503). Refused requests are summarised per source and interval (serve.summaries)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import anyio
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from appliance.changes import Outcome, Target
from audit import AuditEvent, AuditUnavailable, AuditWriter, TextHasher
from serve.auth import key_client
from serve.context import RequestContext, Transcript, context_of, open_context
from serve.errors import GatewayError
from serve.summaries import Refusals, Summaries, cap_text

log = logging.getLogger("appliance.gateway")

AUDITED_PREFIXES = ("/v1/", "/admin/")
INLINE_FLUSH_LIMIT_S = 0.005
ERROR_BODY_BYTES = 4096
CLIENT_GONE = 499  # as nginx logs it: the client closed the connection before the response ended
# What follows a record once it is written, told the request's context, the record's sequence
# number and the record (the gateway's: serve.relay.after_record).
AfterRecord = Callable[[RequestContext, int, AuditEvent], None]
# Declared on a route (`openapi_extra=MONITORING`): a read a dashboard polls, summarised per user.
MONITORING = {"x-audit": "summarised per user and interval"}
# Declared on a route a screen refreshes (`openapi_extra=REFRESHED`): a repeat of the same query by
# the same user is counted into the interval's summary; a new query has its own record.
REFRESHED = {"x-audit": "a repeated query summarised per user and interval; a new query recorded"}


# A path parameter and the kind of object it names; `name` names an object of the route's group.
PARAM_KINDS = {"username": "user", "job_id": "job", "batch_id": "batch", "file_id": "file", "run_id": "rl_run",
               "export_id": "rl_export", "key_name": "key"}
GROUP_KINDS = {"adapters": "adapter", "services": "service", "keys": "key"}


def action_of(scope: Scope, status: int) -> str:
    """A request's action: its matched route's name, which each route declares
    (`name="users.disable"`, `name="services.{action}"`); `unmatched` when no route matched."""
    if status in (401, 403):
        return "auth.denied"
    route = scope.get("route")
    if route is None:
        return "unmatched"
    return str(route.name.format(**(scope.get("path_params") or {})))


def target_of(scope: Scope, action: str, noted: Target | None) -> Target | None:
    """The object a request acted on: what its route noted (`note_target`), else the object its
    path names."""
    if noted is not None:
        return noted
    for param, value in (scope.get("path_params") or {}).items():
        kind = PARAM_KINDS.get(param) or (GROUP_KINDS.get(action.split(".")[0]) if param == "name" else None)
        if kind is not None:
            return Target(kind=kind, name=cap_text(str(value)))
    return None


def note_target(request: Request, kind: str, name: str, *, version: int | None = None,
                roles: list[str] | None = None) -> None:
    """Name the object a route acts on, for its audit record (when the path does not name it, or
    not all of it: a version, the roles granted)."""
    context_of(request).target = Target(kind=kind, name=cap_text(name), version=version, roles=roles)


def note_detail(request: Request, detail: str) -> None:
    """Say what a route's change did, for its audit record (the old and the new value)."""
    context_of(request).detail = cap_text(detail)


def resource_of(scope: Scope) -> str:
    """Where the request was addressed: its path and query, capped."""
    query = scope.get("query_string", b"").decode("latin-1")
    return cap_text(scope["path"] + (f"?{query}" if query else ""))


def read_kind(scope: Scope, event: AuditEvent, count_repeated_reads: bool) -> str | None:
    """A successful read an admin screen polls, counted as one per user and interval: a
    monitoring route per action; with `count_repeated_reads`, a route a screen refreshes per path
    and query, so a new query is recorded and a refresh of the same view is counted. Every other
    read (an RL run's attempts, a file's content, the settings) has a record each time."""
    if event.status >= 400 or scope["method"] != "GET":
        return None
    declared = getattr(scope.get("route"), "openapi_extra", None) or {}
    if declared == MONITORING:
        return event.action
    return event.resource if count_repeated_reads and declared == REFRESHED else None


def reason_of(status: int, body: bytes) -> str | None:
    """A refusal's or failure's reason code: the `code` (else `type`) of its OpenAI-shaped error
    body, else `http_<status>`."""
    if status < 400:
        return None
    if status == CLIENT_GONE:
        return "client_gone"
    try:
        error = json.loads(body).get("error")
        code = error.get("code") or error.get("type")
    except (ValueError, AttributeError):
        code = None
    return cap_text(str(code), 64) if code else f"http_{status}"


def outcome_of(status: int) -> Outcome:
    """allowed; denied (credentials, role, a limit); invalid (any other 4xx: the client's
    fault, a client gone mid-answer too); error (5xx: the appliance's)."""
    if status < 400:
        return "allowed"
    if status in (401, 403, 429):
        return "denied"
    return "invalid" if status < 500 else "error"


class AuditMiddleware:
    """Pure ASGI around /v1/* and /admin/*: refuse at once while the log is unwritable; otherwise
    hold a non-streamed response until its record is on disk (a 503 replaces it if that fails),
    and write a streamed response's record before the bytes holding its end marker go on.

    The record is built with care for hostile input (any text hashes without loss, long fields
    are capped); if building it fails all the same, a record of that failure is written and the
    client gets a 500 (a stream is cut before its end): no answer goes out without a record.

    A lone request writes its record on the event loop: handing it to a thread and back costs
    two thread wake-ups (about 0.3 ms on a 2-core VM), more than the write and flush themselves.
    While other audited requests are in flight, or while the disk is slow (the latest flush took
    over INLINE_FLUSH_LIMIT_S), the record goes to a worker thread instead, where concurrent
    records share one flush: a slow disk stalls neither their streams nor health checks.

    The record is built from the request's context (serve.context), whatever the request filled in
    of it; once written, `after_record` is told of it."""

    def __init__(self, app: ASGIApp, writer: AuditWriter, hasher: TextHasher, capture_text: bool,
                 refusals: Refusals, monitoring: Summaries, count_repeated_reads: bool = True,
                 after_record: AfterRecord | None = None) -> None:
        self.app = app
        self.writer = writer
        self.hasher = hasher
        self.capture = capture_text
        self.refusals = refusals
        self.monitoring = monitoring
        self.count_repeated_reads = count_repeated_reads
        self.after_record = after_record
        self.in_flight = 0
        self._reported_failure: str | None = None

    async def _append(self, event: AuditEvent) -> int:
        """Write `event`; its sequence number."""
        if self.in_flight == 1 and self.writer.last_flush_s < INLINE_FLUSH_LIMIT_S:
            return self.writer.append(event).seq
        return (await anyio.to_thread.run_sync(self.writer.append, event)).seq

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(AUDITED_PREFIXES):
            await self.app(scope, receive, send)
            return
        failure = self.writer.check()
        if failure is not None:
            await self._unavailable(failure).response()(scope, receive, send)
            return
        started = time.monotonic()
        context = open_context(scope)
        held: Message | None = None
        streaming = False
        status = 200
        settled = False
        error_body = bytearray()  # an error's body, for its reason code

        async def audited_send(message: Message) -> None:
            nonlocal held, streaming, status, settled
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = dict(message.get("headers", []))
                streaming = headers.get(b"content-type", b"").startswith(b"text/event-stream")
                if streaming:
                    await send(message)
                else:
                    held = message
                return
            body_ends = message["type"] == "http.response.body" and not message.get("more_body", False)
            if status >= 400 and not streaming and len(error_body) < ERROR_BODY_BYTES:
                error_body.extend(message.get("body", b"")[:ERROR_BODY_BYTES])
            transcript = context.transcript
            # A stream's end marker waits for the record too: a client must not see a complete
            # answer whose record is not on disk.
            if (body_ends or (streaming and transcript is not None and transcript.ended)) and not settled:
                settled = True  # written now, or answered as unwritable
                event, broken = self._event(scope, context, status, started, error_body)
                try:
                    await self._record(event, scope, context)
                except AuditUnavailable as exc:
                    if streaming:
                        raise  # cut the stream: the client must not see a complete answer
                    await self._unavailable(str(exc)).response()(scope, receive, send)
                    return
                if broken:
                    if streaming:
                        raise RuntimeError("audit record could not be built")  # cut the stream
                    await GatewayError(500, "the request's audit record could not be built; its answer is "
                                       "withheld", type="server_error", code="audit_record_failed"
                                       ).response()(scope, receive, send)
                    return
            if held is not None:
                await send(held)
                held = None
            await send(message)

        self.in_flight += 1
        try:
            await self.app(scope, receive, audited_send)
        except Exception:
            if not settled:  # the server answers 500 beyond this middleware
                await self._record_unfinished(scope, context, 500, started, error_body)
            raise
        else:
            if not settled:  # a stream whose client went away before its end
                await self._record_unfinished(scope, context, CLIENT_GONE, started, error_body)
        finally:
            self.in_flight -= 1

    async def _record(self, event: AuditEvent, scope: Scope, context: RequestContext) -> None:
        """Write the request's record, unless it is a refusal or a monitoring read counted into a summary."""
        transcript = context.transcript
        marked = transcript is not None and (transcript.relayed or bool(transcript.marks.done))
        change = scope.get("method") not in ("GET", "HEAD") and str(scope.get("path", "")).startswith("/admin/")
        if not self.refusals.own_record(event, relayed=marked, change=change):
            return
        kind = read_kind(scope, event, self.count_repeated_reads)
        if kind is not None and not self.monitoring.first_of_interval(event, kind):
            return
        seq = await self._append(event)
        if self.after_record is not None:
            self.after_record(context, seq, event)

    async def _record_unfinished(self, scope: Scope, context: RequestContext, status: int, started: float,
                                 error_body: bytearray) -> None:
        """The record of a request that never completed; if even that cannot be written, the
        writer now refuses requests (fail closed) and says why in /readyz."""
        try:
            await self._record(self._event(scope, context, status, started, error_body)[0], scope, context)
        except AuditUnavailable as exc:
            log.error("audit record of unfinished request %s not written: %s", context.request_id, exc)

    def _event(self, scope: Scope, context: RequestContext, status: int, started: float,
               error_body: bytearray) -> tuple[AuditEvent, bool]:
        """The request's record, and whether building it failed (the record then says so)."""
        client = scope.get("client")
        source = client[0] if client else None
        try:
            return self._build(scope, context, status, started, source, bytes(error_body)), False
        except Exception as exc:  # whatever it was, the request still leaves a record
            log.exception("audit record of request %s could not be built", context.request_id)
            return AuditEvent(request_id=context.request_id, action="audit.record_failed",
                              outcome="error", status=500, source=source,
                              latency_ms=round((time.monotonic() - started) * 1000, 1),
                              error=cap_text(f"{type(exc).__name__}: {exc}")), True

    def _build(self, scope: Scope, context: RequestContext, status: int, started: float,
               source: str | None, error_body: bytes) -> AuditEvent:
        who = context.principal
        key = None if who else context.refused_key  # a key found, then refused
        transcript = context.transcript or Transcript()
        action = cap_text(action_of(scope, status))
        completion = transcript.answer.canonical()
        return AuditEvent(
            request_id=context.request_id,
            action=action,
            outcome=outcome_of(status), status=status,
            subject=who.subject if who else None, username=who.username if who else key and key.owner,
            client=who.client if who else key and key_client(key.name), key=who.key if who else key and key.name,
            source=source,
            resource=resource_of(scope), target=target_of(scope, action, context.target),
            model=cap_text(transcript.model) if transcript.model else None,
            reason=reason_of(status, error_body),
            detail=context.detail,
            prompt_tokens=transcript.prompt_tokens, completion_tokens=transcript.completion_tokens,
            latency_ms=round((time.monotonic() - started) * 1000, 1),
            prompt_hmac=self.hasher(transcript.prompt), completion_hmac=self.hasher(completion),
            params_hmac=self.hasher(transcript.params),
            prompt=transcript.prompt if self.capture else None,
            params=transcript.params if self.capture else None,
            completion=completion if self.capture else None,
            tools_called=transcript.answer.tools_called or None,
            tool_arguments_hmac=[str(self.hasher(a)) for a in transcript.answer.tool_arguments] or None,
            sensitive=dict(sorted(transcript.marks.done.items())) or None,
            tier=transcript.tier, replica=transcript.replica, cache_hit_of=transcript.cache_hit_of,
            batch=transcript.batch,
        )

    def _unavailable(self, reason: str) -> GatewayError:
        """503 for a request while the log cannot be written. Its reason (paths, OS errors) goes
        to the gateway's log, once per failure, never to an anonymous client."""
        if reason != self._reported_failure:
            self._reported_failure = reason
            log.error("audit log unavailable, refusing requests: %s", reason)
        return GatewayError(503, "audit log unavailable, refusing requests", type="service_unavailable",
                            code="audit_unavailable", headers={"Retry-After": "30"})
