"""The engines behind the gateway: which pool and replica serve a request, and relaying to it.

The relay uses aiohttp rather than httpx: on the per-request path it costs about half as much
(measured 0.6 vs 1.3 ms a round trip to an instant engine on this 2-core machine), which is most
of the gateway's own latency budget.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from appliance.engine_launch import engine_socket, pool_layout, replica_names
from appliance.home import Home
from appliance.hosts import cluster_state_file, read_cluster_state
from appliance.model_refs import served_name, tiers_of_models
from appliance.settings import RoutingSettings, Settings
from serve.answer import Answer, decode_json
from serve.compliance import AnswerFilter
from serve.engine import ENGINE_BASE_URL
from serve.errors import GatewayError
from serve.metrics import Metrics
from serve.response_cache import Capture
from serve.router import Balancer, pick_tier, split_model

log = logging.getLogger("appliance.gateway")
WATCH_INTERVAL_S = 1.0
# How long a pool spanning hosts that failed a request waits for its controller's verdict: a rank
# elsewhere that died fails the head's next step before the controller hears of it.
CLUSTER_VERDICT_S = 1.0
MODELS_TIMEOUT_S = 10.0
YIELD_POLL_S = 0.02
ENGINE_KEEPALIVE_S = 4.0


@dataclass(frozen=True)
class Replica:
    name: str  # its engine's: the pool's own for the first, <pool>_<i> after (appliance.engine_launch)
    socket: Path  # the engine's Unix socket


@dataclass(frozen=True)
class Pool:
    name: str
    model: str
    replicas: tuple[Replica, ...]
    tier: str | None = None
    max_model_len: int = 2048  # the longest sequence: a request's worst case when it sets no max_tokens
    cluster_state: Path | None = None  # a pool spanning hosts: the controller's state file (serve.cluster)


def pools_from_settings(settings: Settings, home: Home) -> list[Pool]:
    """One upstream per engine pool, named by the model clients ask for, with its replicas."""
    tiers_of_models(settings, home)  # pools serving one model each name a tier of their own
    pools = []
    for p in settings.pools:
        layout = pool_layout(p, settings.engine)
        replicas = tuple(Replica(name, engine_socket(home, name)) for name in replica_names(p))
        pools.append(Pool(name=p.name, model=served_name(p, home), replicas=replicas, tier=p.tier,
                          max_model_len=layout.max_model_len,
                          cluster_state=cluster_state_file(home, p.name) if layout.hosts > 1 else None))
    return pools


def engine_session(replica: Replica, timeout: aiohttp.ClientTimeout) -> aiohttp.ClientSession:
    """An HTTP client that reaches a replica's engine over its Unix socket."""
    # Idle connections go before the engine's own keep-alive (uvicorn: 5 s) closes them under a request.
    return aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(replica.socket), limit=512,
                                                                 keepalive_timeout=ENGINE_KEEPALIVE_S),
                                 timeout=timeout)


@dataclass(frozen=True)
class Sent:
    """An engine's answer (its body unread) and the replica that gives it; `done` once it is read."""

    response: aiohttp.ClientResponse
    replica: Replica
    done: Callable[[], None]


class Upstreams:
    """Routes a model name to its pool (the tier asked for, or the routing policy's) and a request to
    one of the pool's replicas (serve.router), and relays it with the engines' key.

    A replica is sent requests only while it is known to answer. Until its health check passes, and
    again after it refused or dropped a connection (it died), it is set aside: a request goes to
    another replica, and when none answers, first checks their health (one check at a time per
    replica, shared by the requests waiting) and gets 503 if that fails; `watch` checks set-aside
    replicas every second, so one that restarts returns by itself (and the others, so one that died
    is set aside before a request finds it gone). An engine that accepts
    connections but does not answer (still loading behind an open port, or wedged) would otherwise
    hold a request for as long as it stays so: generation has no time limit. vLLM itself binds its
    port early but listens only once it serves, so while it restarts its connections are refused.
    """

    def __init__(self, pools: list[Pool], sessions: Mapping[str, aiohttp.ClientSession], engine_key: str,
                 routing: RoutingSettings | None = None, metrics: Metrics | None = None) -> None:
        self.pools = pools
        self.routing = routing or RoutingSettings()
        self.metrics = metrics or Metrics()
        self._tiers: dict[str, dict[str | None, Pool]] = {}
        for pool in pools:
            self._tiers.setdefault(pool.model, {})[pool.tier] = pool
        self._sessions = sessions  # by replica name: each reaches its engine's socket
        self._headers = {"Authorization": f"Bearer {engine_key}"}
        replicas = [replica for pool in pools for replica in pool.replicas]
        self._ready = {replica.name: False for replica in replicas}
        self._probing = {replica.name: asyncio.Lock() for replica in replicas}
        for pool in pools:
            for replica in pool.replicas:
                self.metrics.replica_ready.labels(pool.name, replica.name).set(0)
        self.balancers = {pool.name: Balancer([r.name for r in pool.replicas], self.routing) for pool in pools}
        self.interactive = {pool.name: 0 for pool in pools}  # interactive (not batch) requests in flight

    def set_balance(self, balance: str) -> None:
        """Change how replicas share requests, for every pool (what they remember stays)."""
        self.routing = self.routing.model_copy(update={"balance": balance})
        for balancer in self.balancers.values():
            balancer.policy = self.routing

    async def _probe(self, pool: Pool, replica: Replica) -> bool:
        """Whether the replica answers, checking its health if it is not known to. A pool spanning
        hosts answers only while its controller says every rank is up (a rank elsewhere that
        died leaves the head's engine answering /health until a request fails)."""
        if pool.cluster_state is not None:
            state = read_cluster_state(pool.cluster_state)
            if state is None or not state.ready:
                self._set_ready(pool, replica, False)
                return False
        if self._ready[replica.name]:
            return True
        async with self._probing[replica.name]:
            if not self._ready[replica.name] and await self.healthy(replica):
                self._set_ready(pool, replica, True)
                log.warning("engine %s takes requests", replica.name)
        return self._ready[replica.name]

    def _set_ready(self, pool: Pool, replica: Replica, ready: bool) -> None:
        self._ready[replica.name] = ready
        self.metrics.replica_ready.labels(pool.name, replica.name).set(1 if ready else 0)

    def is_ready(self, replica: Replica) -> bool:
        return self._ready[replica.name]

    async def check(self) -> None:
        """Check the health of every replica: one that stopped answering is set aside even before a
        request finds it gone; one set aside returns once it answers."""
        for pool in self.pools:
            for replica in pool.replicas:
                if self._ready[replica.name] and pool.cluster_state is None and not await self.healthy(replica):
                    self._set_aside(pool, replica, TimeoutError("no answer to its health check"))
                await self._probe(pool, replica)

    async def watch(self, interval_s: float = WATCH_INTERVAL_S) -> None:
        while True:
            await self.check()
            await asyncio.sleep(interval_s)

    def _unavailable(self, pool: Pool, why: str) -> GatewayError:
        return GatewayError(503, f"engine pool {pool.name!r} is {why}; retry shortly", type="service_unavailable",
                            code="engine_unavailable", headers={"Retry-After": "5"})

    async def _ready_replicas(self, pool: Pool, excluded: Collection[str] = ()) -> list[Replica]:
        """The pool's replicas known to answer; when none is, each checked first (a spanning pool's
        controller is asked every time)."""
        candidates = [replica for replica in pool.replicas if replica.name not in excluded]
        ready = [replica for replica in candidates if self._ready[replica.name]]
        if not ready or pool.cluster_state is not None:
            ready = [replica for replica in candidates if await self._probe(pool, replica)]
        return ready

    def route(self, model: object, *, stream: bool = False, prompt_chars: int = 0) -> tuple[Pool, str]:
        """The pool serving `model` and how its tier was chosen: the tier it names (`NAME:TIER`,
        "named"), else the routing policy's ("policy")."""
        if not isinstance(model, str) or not model:
            raise GatewayError(400, "'model' is required and must be a string", code="missing_model")
        name, tier = split_model(model, self._tiers)
        tiers = self._tiers.get(name)
        if tiers is None:
            raise GatewayError(404, f"model {model!r} does not exist", code="model_not_found")
        pool = pick_tier(name, tiers, tier, stream=stream, prompt_chars=prompt_chars, policy=self.routing)
        return pool, "named" if tier is not None else "policy"

    async def send(self, pool: Pool, path: str, body: bytes, request_id: str, prompt: str = "",
                   interactive: bool = True) -> Sent:
        """POST to one of the pool's replicas (serve.router), the body left unread (streamed). A
        replica that refuses the connection or the request is set aside and the next one tried; one
        that drops it once the request is sent is set aside too, and the request gets a 503 (sent
        on, a request that kills engines would kill them all). No replica answering is a 503 at once, and so is
        a pool spanning hosts whose engine failed because a rank elsewhere stopped. `done` must be
        called once the answer is read."""
        balancer, tried = self.balancers[pool.name], set[str]()
        while True:
            ready = await self._ready_replicas(pool, tried)
            if not ready:
                raise self._unavailable(pool, "not reachable" if tried else
                                        "not ready (starting, or restarting after a failure)")
            choice = balancer.choose(prompt, {replica.name for replica in ready})
            replica = next(replica for replica in ready if replica.name == choice.replica)
            reason = "failover" if tried else choice.reason
            self.metrics.route_choices.labels(pool.name, replica.name, reason).inc()
            # In flight from now: vLLM sends a whole answer's headers only once it is generated.
            done = self._lease(pool, replica, interactive)
            try:
                response = await self._sessions[replica.name].post(
                    f"{ENGINE_BASE_URL}{path}", data=body,
                    headers={**self._headers, "Content-Type": "application/json", "X-Request-Id": request_id})
            except (aiohttp.ClientOSError, aiohttp.ConnectionTimeoutError) as exc:
                # Refused, or the request could not be written (a connection the engine closed as it
                # died): the engine never had it, so another replica may take it.
                done()
                self._set_aside(pool, replica, exc)
                tried.add(replica.name)
                continue
            except aiohttp.ServerDisconnectedError as exc:
                # Dropped after it was sent: the engine may have died of it, so it goes to no other
                # (the batch-worker counts these against a request's attempts).
                done()
                self._set_aside(pool, replica, exc)
                raise GatewayError(503, f"engine pool {pool.name!r} dropped the request; retry shortly",
                                   type="service_unavailable", code="engine_dropped",
                                   headers={"Retry-After": "5"}) from exc
            except (TimeoutError, aiohttp.ClientError) as exc:
                done()
                raise GatewayError(502, f"engine pool {pool.name!r} failed: {type(exc).__name__}",
                                   type="upstream_error", code="engine_error") from exc
            except BaseException:
                done()
                raise
            if response.status >= 500 and pool.cluster_state is not None and await self._cluster_failed(pool):
                response.release()
                done()
                self._set_ready(pool, replica, False)
                raise self._unavailable(pool, "restarting (a rank on another host stopped)")
            return Sent(response, replica, done)

    def _set_aside(self, pool: Pool, replica: Replica, why: BaseException) -> None:
        self._set_ready(pool, replica, False)
        log.warning("engine %s set aside until its health check passes: %s", replica.name, type(why).__name__)

    def _lease(self, pool: Pool, replica: Replica, interactive: bool) -> Callable[[], None]:
        """Count a request in flight on `replica` until the returned function is called (once)."""
        balancer = self.balancers[pool.name]
        balancer.started(replica.name)
        self.interactive[pool.name] += interactive
        gauge = self.metrics.replica_in_flight.labels(pool.name, replica.name)
        gauge.inc()
        ended = False

        def done() -> None:
            nonlocal ended
            if not ended:
                ended = True
                balancer.finished(replica.name)
                self.interactive[pool.name] -= interactive
                gauge.dec()
        return done

    async def quiet(self, pool: Pool, busy: int, max_wait_s: float) -> None:
        """Wait while `busy` or more interactive requests are in flight on the pool (batch requests
        yield to them), `max_wait_s` at most; busy 0: never wait."""
        deadline = asyncio.get_running_loop().time() + max_wait_s
        while busy and self.interactive[pool.name] >= busy and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(YIELD_POLL_S)

    async def _cluster_failed(self, pool: Pool) -> bool:
        """Whether the controller of a pool spanning hosts declares it failed within CLUSTER_VERDICT_S."""
        assert pool.cluster_state is not None
        deadline = asyncio.get_running_loop().time() + CLUSTER_VERDICT_S
        while True:
            state = read_cluster_state(pool.cluster_state)
            if state is None or not state.ready:
                return True
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(0.05)

    def pool(self, name: str) -> Pool:
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise GatewayError(404, f"no engine pool named {name!r}", code="not_found")

    async def engine_post(self, pool: Pool, path: str, body: dict[str, str]) -> list[tuple[Replica, int, str]]:
        """A control request (the LoRA endpoints) to each of the pool's replicas that answers: each
        one's status and text. A replica set aside is left out: it gets what it lacks when a request
        finds it missing. 503 if no replica answers."""
        answers = []
        for replica in await self._ready_replicas(pool):
            try:
                async with self._sessions[replica.name].post(
                        f"{ENGINE_BASE_URL}{path}", json=body, headers=self._headers,
                        timeout=aiohttp.ClientTimeout(total=120)) as response:
                    answers.append((replica, response.status, await response.text()))
            except (TimeoutError, aiohttp.ClientError):
                self._set_ready(pool, replica, False)
        if not answers:
            raise self._unavailable(pool, "not reachable")
        return answers

    async def models(self) -> list[dict[str, Any]]:
        """Every ready pool's /v1/models entries (from one replica); pools that do not answer are left out."""
        data: list[dict[str, Any]] = []
        for pool in self.pools:
            for replica in await self._ready_replicas(pool):
                try:
                    async with self._sessions[replica.name].get(
                            f"{ENGINE_BASE_URL}/v1/models", headers=self._headers, raise_for_status=True,
                            timeout=aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S)) as response:
                        data.extend((await response.json(content_type=None)).get("data", []))
                    break
                except (TimeoutError, aiohttp.ClientError, ValueError, AttributeError):
                    continue
        return data

    async def healthy(self, replica: Replica) -> bool:
        try:
            async with self._sessions[replica.name].get(f"{ENGINE_BASE_URL}/health",
                                                        timeout=aiohttp.ClientTimeout(total=2.0)) as response:
                return response.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False


async def read_answer(response: aiohttp.ClientResponse, pool: Pool) -> bytes:
    """A whole (non-streamed) answer from the engine; 502 if the engine fails mid-answer."""
    try:
        return await response.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise GatewayError(502, f"engine pool {pool.name!r} failed: {type(exc).__name__}",
                           type="upstream_error", code="engine_error") from exc
    finally:
        response.release()


def usage_of(answer: object) -> tuple[int, int]:
    """(prompt, completion) tokens from a parsed OpenAI response or final stream chunk."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    if not isinstance(usage, dict):
        return 0, 0
    return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)


async def relay_stream(response: aiohttp.ClientResponse, answer: Answer, on_first_token: Callable[[], None],
                       on_usage: Callable[[int | None, int], None],
                       on_end: Callable[[], None], screen: AnswerFilter | None = None,
                       sent: Capture | None = None) -> AsyncIterator[bytes]:
    """Pass SSE through line by line as it arrives; gather the answer, note the first token,
    the usage and the end marker.

    Only complete lines are passed on, and the end is found by parsing them: `on_end` runs when
    the line `data: [DONE]` has arrived and before the bytes holding it go on (a prompt echoed
    back inside an event's JSON never ends the stream early).

    Usage is reported once, before the end marker goes on: the last usage seen (a client that
    asked for continuous usage gets running totals in every chunk), or, for a stream cut short
    before its usage chunk, prompt unknown (None) and one completion token per text chunk seen.

    With `screen` (compliance filtering), each event goes out re-encoded with its text redacted,
    and what it still held goes out in events of its own before the end marker. With `sent`, each
    chunk is also added to it before it goes on (the response cache keeps what the client got).

    When the client goes away, the server cancels this generator; closing the upstream connection
    then makes vLLM abort the request, freeing the engine.
    """
    first = True
    pending = b""
    finished = False
    usage: tuple[int | None, int] | None = None
    text_chunks = 0
    reported = False

    def report() -> None:
        nonlocal reported
        if not reported:
            reported = True
            on_usage(*(usage if usage is not None else (None, text_chunks)))

    try:
        async for chunk in response.content.iter_any():
            pending += chunk
            cut = pending.rfind(b"\n") + 1
            if not cut:
                continue
            complete, pending = pending[:cut], pending[cut:]
            lines = []
            for line in complete.splitlines(keepends=True):
                lines.append(line)
                if line.rstrip(b"\r\n") == b"data: [DONE]":
                    if screen is not None:  # what it held back goes out before the end
                        held = screen.finish()
                        lines[-1:] = [*(_event_line(event) + b"\n" for event in held), line]
                        for extra in held:
                            answer.add_choices(extra.get("choices"))
                    report()
                    on_end()
                    continue
                if not line.startswith(b"data:"):
                    continue
                try:
                    event = decode_json(line[len(b"data:"):])
                except ValueError:
                    event = None
                if not isinstance(event, dict):
                    answer.add_unparsed(line.rstrip(b"\r\n"))
                    if screen is not None:
                        lines.pop()  # what cannot be screened does not go out
                    continue
                if "error" in event:
                    answer.failed = True
                if screen is not None:
                    lines[-1] = _event_line(screen.event(event))  # changed in place
                if answer.add_choices(event.get("choices")):
                    text_chunks += 1
                    if first:
                        first = False
                        on_first_token()
                if event.get("usage"):
                    usage = usage_of(event)
            out = b"".join(lines) if screen is not None else complete
            if sent is not None:
                sent.append(out)
            yield out
        if pending:
            answer.add_unparsed(pending)
            if screen is None:
                if sent is not None:
                    sent.append(pending)
                yield pending
        finished = True
    finally:
        report()
        if finished:
            response.release()  # the connection goes back to the pool
        else:
            response.close()  # drop the connection: the engine sees the client leave
        if screen is not None:  # last: whatever it raises, the engine is let go first
            screen.settle()


def _event_line(event: dict[str, Any]) -> bytes:
    """An SSE data line of `event` (ASCII JSON: whatever the text holds, lone surrogates included)."""
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n"
