"""Every /v1 and /admin request, allowed or denied, leaves a durable audit record before its
response is complete (one that never completes too: status 499 when the client went away
mid-stream, 500 when the server failed); if the log cannot be written the gateway fails closed
(503)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import anyio

from audit import AuditEvent, AuditUnavailable, AuditWriter, TextHasher
from serve.auth import Principal
from serve.errors import GatewayError

log = logging.getLogger("appliance.gateway")

AUDITED_PREFIXES = ("/v1/", "/admin/")
INLINE_FLUSH_LIMIT_S = 0.005
STREAM_END = b"data: [DONE]"
CLIENT_GONE = 499  # as nginx logs it: the client closed the connection before the response ended
ACTIONS = {("POST", "/v1/chat/completions"): "chat.completions", ("POST", "/v1/completions"): "completions",
           ("GET", "/v1/models"): "models.list", ("POST", "/admin/users"): "users.add",
           ("POST", "/admin/users/{username}/disable"): "users.disable",
           ("POST", "/admin/services/{name}/{action}"): "services.{action}",
           ("POST", "/admin/users/{username}/roles"): "users.grant_role",
           ("GET", "/admin/audit"): "audit.query", ("POST", "/admin/audit/verify"): "audit.verify",
           ("POST", "/admin/jobs/{job_id}/cancel"): "jobs.cancel",
           **{("POST", f"/admin/adapters/{{name}}/{change}"): f"adapters.{change}"
              for change in ("deploy", "canary", "rollback", "retire")}}


def action_of(scope: dict, status: int) -> tuple[str, str | None]:
    """(action, resource named in the path) for a request, from its matched route."""
    if status in (401, 403):
        return "auth.denied", None
    template = getattr(scope.get("route"), "path", scope["path"])
    params = scope.get("path_params") or {}
    action = ACTIONS.get((scope["method"], template))
    if action is None:
        action = "admin.read" if template.startswith("/admin/") else f"{scope['method']} {template}"
    return action.format(**params), params.get("username") or params.get("name") or params.get("job_id")


@dataclass
class Transcript:
    """What a handler learned about the request, for its audit record."""

    model: str | None = None
    prompt: str | None = None
    completion_parts: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def completion(self) -> str | None:
        return "".join(self.completion_parts) if self.completion_parts else None


def outcome_of(status: int) -> str:
    if status < 400:
        return "allowed"
    return "denied" if status in (401, 403, 429) else "error"


class AuditMiddleware:
    """Pure ASGI around /v1/* and /admin/*: refuse at once while the log is unwritable; otherwise
    hold a non-streamed response until its record is on disk (a 503 replaces it if that fails),
    and write a streamed response's record before its last chunk.

    A lone request writes its record on the event loop: handing it to a thread and back costs
    two thread wake-ups (about 0.3 ms on a 2-core VM), more than the write and flush themselves.
    While other audited requests are in flight, or while the disk is slow (the latest flush took
    over INLINE_FLUSH_LIMIT_S), the record goes to a worker thread instead, where concurrent
    records share one flush: a slow disk stalls neither their streams nor health checks."""

    def __init__(self, app: Any, writer: AuditWriter, hasher: TextHasher, capture_text: bool) -> None:
        self.app = app
        self.writer = writer
        self.hasher = hasher
        self.capture = capture_text
        self.in_flight = 0

    async def _append(self, event: AuditEvent) -> None:
        if self.in_flight == 1 and self.writer.last_flush_s < INLINE_FLUSH_LIMIT_S:
            self.writer.append(event)
        else:
            await anyio.to_thread.run_sync(self.writer.append, event)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(AUDITED_PREFIXES):
            await self.app(scope, receive, send)
            return
        failure = self.writer.check()
        if failure is not None:
            await _unavailable(failure).response()(scope, receive, send)
            return
        started = time.monotonic()
        state = scope.setdefault("state", {})
        held: dict | None = None
        streaming = False
        status = 200
        settled = False

        async def audited_send(message: dict) -> None:
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
            # A stream's end marker waits for the record too: a client must not see a complete
            # answer whose record is not on disk.
            if (body_ends or (streaming and STREAM_END in message.get("body", b""))) and not settled:
                settled = True  # written now, or answered as unwritable
                try:
                    await self._append(self._event(scope, state, status, started))
                except AuditUnavailable as exc:
                    if streaming:
                        raise  # cut the stream: the client must not see a complete answer
                    await _unavailable(str(exc)).response()(scope, receive, send)
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
                await self._record_unfinished(scope, state, 500, started)
            raise
        else:
            if not settled:  # a stream whose client went away before its end
                await self._record_unfinished(scope, state, CLIENT_GONE, started)
        finally:
            self.in_flight -= 1

    async def _record_unfinished(self, scope: dict, state: dict, status: int, started: float) -> None:
        """The record of a request that never completed; if even that cannot be written, the
        writer now refuses requests (fail closed) and says why in /readyz."""
        try:
            await self._append(self._event(scope, state, status, started))
        except AuditUnavailable as exc:
            log.error("audit record of unfinished request %s not written: %s", state.get("request_id"), exc)

    def _event(self, scope: dict, state: dict, status: int, started: float) -> AuditEvent:
        who: Principal | None = state.get("principal")
        transcript: Transcript = state.get("transcript") or Transcript()
        action, named = action_of(scope, status)
        client = scope.get("client")
        return AuditEvent(
            request_id=state.get("request_id", ""),
            action=action,
            outcome=outcome_of(status), status=status,
            subject=who.subject if who else None, username=who.username if who else None,
            client=who.client if who else None, source=client[0] if client else None,
            resource=transcript.model or named or scope["path"],
            prompt_tokens=transcript.prompt_tokens, completion_tokens=transcript.completion_tokens,
            latency_ms=round((time.monotonic() - started) * 1000, 1),
            prompt_hmac=self.hasher(transcript.prompt), completion_hmac=self.hasher(transcript.completion),
            prompt=transcript.prompt if self.capture else None,
            completion=transcript.completion if self.capture else None,
        )


def _unavailable(reason: str) -> GatewayError:
    return GatewayError(503, f"audit log unavailable, refusing requests: {reason}",
                        type="service_unavailable", code="audit_unavailable", headers={"Retry-After": "30"})
