"""The relay of /v1 chat and text completions: route (tier, adapter), admit, screen, answer from
the cache or forward to an engine; stream back as it arrives; account tokens and time to first
token; and, once the request's record is written (`after_record`), keep the answer in the cache
and give an adapter answer's figures to the canary analysis."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, cast

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from appliance.adapters import AdapterRecord
from appliance.api_keys import ref as key_ref
from appliance.roles import Role
from audit import AuditEvent
from serve.answer import Answer, decode_json
from serve.audit_trail import AfterRecord
from serve.auth import Principal
from serve.compliance import Marks
from serve.context import AdapterAnswer, CacheCandidate, RequestContext, Transcript, context_of
from serve.errors import GatewayError
from serve.lifespan import Gateway
from serve.limits import Admission
from serve.metrics import Metrics
from serve.replicas import Pool
from serve.response_cache import CachedAnswer, Capture, ResponseCache, deterministic, wants
from serve.schemas import ChatRequest, CompletionRequest
from serve.sse_relay import Checks, relay_stream, usage_of
from serve.tool_calls import InvalidToolCall, ToolCheck
from serve.upstream import read_answer


async def relay(request: Request, who: Principal, path: str, body: ChatRequest | CompletionRequest) -> Response:
    """Route (tier, adapter), admit, screen, answer from the cache or forward; stream back as it
    arrives; account tokens and time to first token."""
    gateway: Gateway = request.app.state.gateway
    context = context_of(request)
    batch = context.batch  # a batch request the batch-worker sends
    context.transcript = Transcript(model=body.model, batch=batch)  # a refusal's record names the model asked
    if not who.may_use(body.model):
        raise GatewayError(403, f"API key {who.key!r} may use only: {', '.join(sorted(who.models or ()))}",
                           type="permission_error", code="model_not_allowed", param="model")
    payload = body.relayed()
    routed = gateway.adapters.resolve(body.model, who.roles)
    if routed is not None:
        pool, payload["model"], adapter = routed
        how = "adapter"
    else:
        (pool, how), adapter = gateway.upstreams.route(body.model, stream=bool(body.stream) and not batch,
                                                       prompt_chars=len(body.prompt_text(payload))), None
        payload["model"] = pool.model  # a tier asked for by name (MODEL:TIER) is the engine's model
    gateway.metrics.tier_requests.labels(pool.model, pool.tier or "-", how).inc()
    policy, marks = gateway.compliance.policy(who.roles), Marks()
    transcript = context.transcript = Transcript(model=payload["model"], marks=marks, tier=pool.tier, batch=batch)
    prompt_estimate, worst_completion = body.admission(gateway.limiter.limits_for(who.roles), pool.max_model_len,
                                                       payload, body.prompt_text(payload))
    if body.stream:
        # Ask for the final usage chunk so tokens can be counted and charged.
        payload["stream_options"] = {**(payload.get("stream_options") or {}), "include_usage": True}
    admission = gateway.limiter.admit(who.subject, who.roles, prompt_tokens=prompt_estimate,
                                      completion_tokens=worst_completion)
    if who.key is not None and who.tokens_per_minute is not None:
        try:
            # By owner and name: two users' keys of one name have budgets of their own.
            admission.also = gateway.limiter.admit_key(key_ref(who.username, who.key), who.tokens_per_minute,
                                                       prompt_tokens=prompt_estimate,
                                                       completion_tokens=worst_completion)
        except GatewayError:
            admission.settle(0, 0)  # the owner's hold goes back: the key's budget refused it
            raise
    headers = {"X-Appliance-Tier": pool.tier} if pool.tier else {}
    try:
        # Compliance filtering, once admitted (a hostile 1 MiB prompt takes a second or more to
        # scan, in a thread): every string the client sent but the model's name (stop strings and
        # tool schemas reach the engine too). The prompt hashed and relayed is the screened one.
        fields = tuple(name for name in payload if name != "model")
        await anyio.to_thread.run_sync(gateway.compliance.screen_prompt, payload, fields, policy, marks)
        screen = gateway.compliance.answer_filter(policy, marks)
        # The calls the model returns are checked against the functions the engine was offered.
        tools = ToolCheck.of(payload.get("tools"), payload.get("tool_choice"),
                             lambda outcome: gateway.metrics.tool_calls.labels(pool.model, outcome).inc())
        transcript.prompt = body.prompt_text(payload)  # max_tokens and stream_options, set above, shape no prompt
        transcript.params = body.params_text(payload)  # they are among these: what the engine is asked
        keep = None  # the cache key to keep the answer by
        lookup, store = wants(request.headers.get("cache-control"))
        if gateway.cache.settings.enabled and deterministic(payload) and store:
            key = gateway.cache.key(subject=who.subject, roles=who.roles, path=path, pool=pool.name, payload=payload)
            if lookup and (hit := gateway.cache.get(key)) is not None:
                gateway.cache.count("hit")
                admission.settle(0, 0)  # the engine did nothing: no tokens are charged
                return _replay(hit, transcript, {**headers, "X-Appliance-Cache": "hit"})
            gateway.cache.count("miss" if lookup else "bypass")
            headers["X-Appliance-Cache"] = "miss" if lookup else "bypass"
            keep = key
        if batch is not None:
            await gateway.upstreams.quiet(pool, gateway.settings.batch.yield_to_interactive,
                                          gateway.settings.batch.max_yield_s)
        if adapter is not None:  # an answer from the engine (a cache hit says nothing of the version)
            context.adapter_answer = AdapterAnswer(adapter, who.subject, bool(body.stream))
        # An adapter's answers name the alias asked for, not the version that answered (the audit
        # record keeps that): a client that cannot tell canary answers apart cannot report on them
        # selectively. The RL service identity, which no person holds, is told the version it trains.
        named = adapter.name if adapter is not None and Role.RL_POLICY not in who.roles else None
        return await _forward(context, transcript, gateway, pool, adapter, path, payload, admission,
                              Checks(screen, tools), headers, keep, body.model, named)
    except GatewayError:
        admission.settle(0, 0)  # refused before the engine saw it
        raise
    except BaseException:
        admission.settle(None, 0)  # the engine may have seen the prompt: it is charged
        raise


def after_record(app: FastAPI) -> AfterRecord:
    """What follows a relayed request's record once it is written (serve.audit_trail): the cache
    keeps the answer the relay noted, by the record's sequence number, and an adapter answer's
    figures go to the metrics and the canary analysis."""
    def follow(context: RequestContext, seq: int, event: AuditEvent) -> None:
        transcript = context.transcript
        if transcript is None:  # not relayed
            return
        gateway: Gateway = app.state.gateway
        if context.cache_candidate is not None and event.status == 200:
            _keep(gateway.cache, context.cache_candidate, transcript, seq)
        if (served := context.adapter_answer) is not None:
            adapter = served.adapter
            gateway.metrics.adapter_requests.labels(adapter.name, str(adapter.version), str(event.status)).inc()
            latency_s = None if served.stream else (event.latency_ms or 0.0) / 1000
            gateway.adapters.canaries.served(adapter.name, adapter.version, served.subject, transcript.answer.id,
                                             status=event.status, failed=transcript.answer.failed,
                                             latency_s=latency_s, ttft_s=transcript.ttft_s)
    return follow


def _keep(cache: ResponseCache, candidate: CacheCandidate, transcript: Transcript, seq: int) -> None:
    """Keep a recorded answer in the cache: a stream's only if it reached its end, with no error and
    not too large to keep."""
    if transcript.answer.failed or (candidate.stream and not transcript.ended) or \
            (isinstance(candidate.chunks, Capture) and candidate.chunks.overflowed):
        return
    marks = tuple(sorted((where, done) for where, done in transcript.marks.done.items() if where.startswith("answer.")))
    cache.put(candidate.key, CachedAnswer(tuple(candidate.chunks), candidate.stream, candidate.media_type, seq,
                                          candidate.model, marks, cache.expires()))


def _replay(hit: CachedAnswer, transcript: Transcript, headers: dict[str, str]) -> Response:
    """A cached answer, as its first client got it; its record names the original's."""
    transcript.cache_hit_of = hit.seq
    transcript.marks.done.update(hit.answer_marks)
    if not hit.stream:
        answer = decode_json(hit.chunks[0])
        transcript.answer.add_choices(answer.get("choices") if isinstance(answer, dict) else None)
        return Response(hit.chunks[0], media_type=hit.media_type, headers=headers)
    for line in b"".join(hit.chunks).splitlines():
        event = decode_json(line[len(b"data:"):]) if line.startswith(b"data:") and line != b"data: [DONE]" else None
        if isinstance(event, dict):
            transcript.answer.add_choices(event.get("choices"))
    transcript.end()

    async def replayed() -> AsyncIterator[bytes]:  # on the event loop: no thread hop per chunk
        for chunk in hit.chunks:
            yield chunk

    return StreamingResponse(replayed(), media_type=hit.media_type, headers={**headers, "Cache-Control": "no-cache"})


async def _forward(context: RequestContext, transcript: Transcript, gateway: Gateway, pool: Pool,
                   adapter: AdapterRecord | None, path: str, payload: dict[str, Any], admission: Admission,
                   checks: Checks, headers: dict[str, str], keep: str | None, asked: str,
                   named: str | None) -> Response:
    """Send to `pool` and relay its answer, its tool calls checked and its text screened; `keep`:
    the cache key to keep the answer by once recorded (`asked`: the model the client named)."""
    screen, tools = checks.screen, checks.tools
    request_id = context.request_id
    started = time.monotonic()
    transcript.relayed = True
    prefix, interactive = transcript.prompt or "", transcript.batch is None
    try:
        sent = await gateway.upstreams.send(pool, path, json.dumps(payload).encode(), request_id, prefix, interactive)
        if adapter is not None and sent.response.status == 404:  # the engine restarted and forgot it
            sent.response.release()
            sent.done()
            await gateway.adapters.load(pool, adapter)
            sent = await gateway.upstreams.send(pool, path, json.dumps(payload).encode(), request_id, prefix,
                                                interactive)
    except GatewayError as exc:
        gateway.metrics.upstream_errors.labels(pool.name, exc.code or "error").inc()
        raise
    response, transcript.replica = sent.response, sent.replica.name
    account = Accounting(gateway.metrics, pool, admission, transcript, started)

    if not payload.get("stream") or response.status != 200:
        try:
            content = await read_answer(response, pool)
        except GatewayError:
            gateway.metrics.upstream_errors.labels(pool.name, "read").inc()
            raise
        finally:
            sent.done()
        if response.status >= 500:
            gateway.metrics.upstream_errors.labels(pool.name, str(response.status)).inc()
        try:
            answer = decode_json(content)
        except ValueError:
            answer = None
        if named is not None and response.status == 200 and isinstance(answer, dict) and \
                answer.get("model") != named:
            answer["model"] = named
            content = json.dumps(answer, separators=(",", ":")).encode()
        if screen is not None and response.status == 200:
            if not isinstance(answer, dict):  # what cannot be screened does not go out
                account.usage(None, 0)  # the engine worked: the prompt is charged
                gateway.metrics.upstream_errors.labels(pool.name, "unscreened").inc()
                raise GatewayError(502, "the engine's answer could not be screened for sensitive data",
                                   type="server_error", code="unscreened_answer")
            answer = await anyio.to_thread.run_sync(screen.answer, answer)
            content = json.dumps(answer, separators=(",", ":")).encode()
        if tools is not None and response.status == 200 and isinstance(answer, dict):
            try:  # the calls that would go out (redacted first), in a thread: a schema may be slow
                await anyio.to_thread.run_sync(tools.answer, answer)
            except InvalidToolCall:
                account.usage(*usage_of(answer))  # the engine worked: its tokens are charged
                transcript.answer.add_choices(answer.get("choices"))  # the record names what it tried
                raise
        account.usage(*usage_of(answer))
        transcript.answer.note_id(answer)
        if isinstance(answer, dict):
            transcript.answer.add_choices(answer.get("choices"))
        elif content:
            transcript.answer.add_unparsed(content)
        # An engine error is translated to JSON whatever the engine's own type said (read_answer).
        media_type = response.headers.get("content-type", "application/json") if response.status == 200 \
            else "application/json"
        if keep is not None and response.status == 200 and isinstance(answer, dict):
            context.cache_candidate = CacheCandidate(keep, asked, [content], False, media_type)
        return Response(content, status_code=response.status, media_type=media_type, headers=headers)

    sent_chunks = None
    if keep is not None:
        sent_chunks = Capture(gateway.cache.settings.max_entry_bytes)
        context.cache_candidate = CacheCandidate(keep, asked, sent_chunks, True, "text/event-stream")
    return SettlingStream(admission, relay_stream(response, account, checks, sent_chunks, named),
                          release=sent.done, media_type="text/event-stream",
                          headers={**headers, "Cache-Control": "no-cache"})


@dataclass


class Accounting:
    """A relayed answer's tokens (metrics, the admission, the request's transcript) and its time to
    first token; the stream relay (serve.sse_relay) tells it as a stream passes."""

    metrics: Metrics
    pool: Pool
    admission: Admission
    transcript: Transcript
    started: float

    @property
    def answer(self) -> Answer:
        return self.transcript.answer

    def first_token(self) -> None:
        self.transcript.ttft_s = time.monotonic() - self.started
        self.metrics.ttft.labels(self.pool.model).observe(self.transcript.ttft_s)

    def usage(self, prompt_tokens: int | None, completion_tokens: int) -> None:
        """Count and charge the tokens; prompt None (a stream cut short): the admission's estimate."""
        prompt = self.admission.prompt_estimate if prompt_tokens is None else prompt_tokens
        self.transcript.prompt_tokens, self.transcript.completion_tokens = prompt, completion_tokens
        self.metrics.tokens.labels("in", self.pool.model).inc(prompt)
        self.metrics.tokens.labels("out", self.pool.model).inc(completion_tokens)
        self.admission.settle(prompt, completion_tokens)

    def end(self) -> None:
        self.transcript.end()


class SettlingStream(StreamingResponse):
    """A relayed stream that settles its admission however it ends, even when the client left
    before the first byte (the stream's generator then never runs)."""

    def __init__(self, admission: Admission, *args: Any, release: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.admission = admission
        self.release = release  # the replica's request in flight ends

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                # Close the relay now (a generator left at its `yield` is not), so that its own ending
                # (usage, compliance marks, the engine let go) comes before the request's record.
                await cast(AsyncGenerator[bytes, None], self.body_iterator).aclose()
            finally:
                self.release()
                self.admission.settle(None, 0)
