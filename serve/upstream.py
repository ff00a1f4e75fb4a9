"""Where a request to the engines goes, and sending it there: the pool serving a model name (the
tier asked for, or the routing policy's), the replica (serve.router, among those serve.replicas
knows to answer), a lease counting it in flight, and failover to another replica when one refuses.

The relay uses aiohttp rather than httpx: on the per-request path it costs about half as much
(measured 0.6 vs 1.3 ms a round trip to an instant engine on this 2-core machine), which is most
of the gateway's own latency budget. The answer's stream is relayed by serve.sse_relay.

A request lasts as long as its replica answers, however long its prefill or generation: once the
replica is gone (serve.replicas: no health check answered for NO_ANSWER_S, a wedged engine), a
request still waiting for its answer's headers gets a 503 and an answer being read is cut.

What comes back from the engines is put in the gateway's terms here: an error answer in OpenAI's
error shape (serve.errors.engine_error), a model list with names, never the checkpoints' paths.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from appliance.settings import RoutingSettings
from serve.answer import decode_json
from serve.engine import ENGINE_BASE_URL
from serve.engine_metrics import EngineMetricsRelay
from serve.errors import GatewayError, ModelNotFound, engine_error
from serve.metrics import Metrics
from serve.replicas import NO_ANSWER_S, Pool, Replica, ReplicaSet
from serve.router import Balancer, pick_tier, split_model

MODELS_TIMEOUT_S = 10.0
YIELD_POLL_S = 0.02
T = TypeVar("T")


class EngineGone(aiohttp.ClientConnectionError):
    """The replica stopped answering while its answer was awaited or read (an aiohttp error, so
    every reader of an answer already handles it)."""


async def unless_gone(gone: asyncio.Event, work: Awaitable[T]) -> T:
    """`work`'s result, or EngineGone once `gone` is set first (`work` is then cancelled)."""
    task, waiter = asyncio.ensure_future(work), asyncio.ensure_future(gone.wait())
    try:
        await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        raise EngineGone("the engine stopped answering")
    return task.result()


def _cut_when_gone(gone: asyncio.Event, response: aiohttp.ClientResponse,
                   done: Callable[[], None]) -> Callable[[], None]:
    """Cut the answer being read if its replica is gone first (its reader gets EngineGone); the
    returned function ends the watch and calls `done`."""
    async def cut() -> None:
        await gone.wait()
        response.content.set_exception(EngineGone("the engine stopped answering mid-answer"))
        response.close()
    watch = asyncio.ensure_future(cut())

    def read() -> None:
        watch.cancel()
        done()
    return read


@dataclass(frozen=True)
class Sent:
    """An engine's answer (its body unread) and the replica that gives it; `done` once it is read."""

    response: aiohttp.ClientResponse
    replica: Replica
    done: Callable[[], None]


class Upstreams:
    """Routes a model name to its pool (the tier asked for, or the routing policy's) and a request to
    one of the pool's replicas (serve.router), and relays it with the engines' key.

    Only replicas known to answer are sent requests (`replicas`, serve.replicas): a request goes to
    another replica when one refuses it, and when none answers, first checks their health and gets
    503 if that fails.
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
        self._engine_metrics = EngineMetricsRelay(pools, sessions, self._headers)
        self.replicas = ReplicaSet(pools, sessions, self.metrics)
        self.balancers = {pool.name: Balancer([r.name for r in pool.replicas], self.routing) for pool in pools}
        self.interactive = {pool.name: 0 for pool in pools}  # interactive (not batch) requests in flight

    def set_balance(self, balance: str) -> None:
        """Change how replicas share requests, for every pool (what they remember stays)."""
        self.routing = self.routing.model_copy(update={"balance": balance})
        for balancer in self.balancers.values():
            balancer.policy = self.routing

    def _unavailable(self, pool: Pool, why: str) -> GatewayError:
        return GatewayError(503, f"engine pool {pool.name!r} is {why}; retry shortly", type="service_unavailable",
                            code="engine_unavailable", headers={"Retry-After": "5"})

    def route(self, model: object, *, stream: bool = False, prompt_chars: int = 0) -> tuple[Pool, str]:
        """The pool serving `model` and how its tier was chosen: the tier it names (`NAME:TIER`,
        "named"), else the routing policy's ("policy")."""
        if not isinstance(model, str) or not model:
            raise GatewayError(400, "'model' is required and must be a string", code="missing_model")
        name, tier = split_model(model, self._tiers)
        tiers = self._tiers.get(name)
        if tiers is None:
            raise ModelNotFound(f"model {model!r} does not exist", self._tiers)
        pool = pick_tier(name, tiers, tier, stream=stream, prompt_chars=prompt_chars, policy=self.routing)
        return pool, "named" if tier is not None else "policy"

    async def send(self, pool: Pool, path: str, body: bytes, request_id: str, prompt: str = "",
                   interactive: bool = True) -> Sent:
        """POST to one of the pool's replicas (serve.router), the body left unread (streamed). A
        replica that refuses the connection or the request is set aside and the next one tried; one
        that drops it once the request is sent is set aside too, and the request gets a 503 (sent
        on, a request that kills engines would kill them all), and so is one that stops answering
        before the answer's headers (gone, serve.replicas). No replica answering is a 503 at once, and
        so is a pool spanning hosts whose engine failed because a rank elsewhere stopped. `done` must
        be called once the answer is read; until then, the answer is cut if its replica is gone."""
        balancer, tried = self.balancers[pool.name], set[str]()
        while True:
            ready = await self.replicas.ready(pool, tried)
            if not ready:
                raise self._unavailable(pool, "not reachable" if tried else
                                        "not ready (starting, or restarting after a failure)")
            choice = balancer.choose(prompt, {replica.name for replica in ready})
            replica = next(replica for replica in ready if replica.name == choice.replica)
            reason = "failover" if tried else choice.reason
            self.metrics.route_choices.labels(pool.name, replica.name, reason).inc()
            # In flight from now: vLLM sends a whole answer's headers only once it is generated.
            done = self._lease(pool, replica, interactive)
            gone = self.replicas.gone(replica)
            try:
                response = await unless_gone(gone, self._sessions[replica.name].post(
                    f"{ENGINE_BASE_URL}{path}", data=body,
                    headers={**self._headers, "Content-Type": "application/json", "X-Request-Id": request_id}))
            except EngineGone as exc:
                # Sent, and the engine stopped answering (wedged): as with a drop, no other replica.
                done()
                raise GatewayError(503, f"engine pool {pool.name!r} stopped answering (no answer for "
                                   f"{NO_ANSWER_S:.0f} s); retry shortly", type="service_unavailable",
                                   code="engine_not_answering", headers={"Retry-After": "5"}) from exc
            except (aiohttp.ClientOSError, aiohttp.ConnectionTimeoutError) as exc:
                # Refused, or the request could not be written (a connection the engine closed as it
                # died): the engine never had it, so another replica may take it.
                done()
                self.replicas.set_aside(pool, replica, exc)
                tried.add(replica.name)
                continue
            except aiohttp.ServerDisconnectedError as exc:
                # Dropped after it was sent: the engine may have died of it, so it goes to no other
                # (the batch-worker counts these against a request's attempts).
                done()
                self.replicas.set_aside(pool, replica, exc)
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
            if response.status >= 500 and pool.cluster_state is not None and await self.replicas.cluster_failed(pool):
                response.release()
                done()
                self.replicas.set_ready(pool, replica, False)
                raise self._unavailable(pool, "restarting (a rank on another host stopped)")
            return Sent(response, replica, _cut_when_gone(gone, response, done))

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
        for replica in await self.replicas.ready(pool):
            try:
                async with self._sessions[replica.name].post(
                        f"{ENGINE_BASE_URL}{path}", json=body, headers=self._headers,
                        timeout=aiohttp.ClientTimeout(total=120)) as response:
                    answers.append((replica, response.status, await response.text()))
            except (TimeoutError, aiohttp.ClientError):
                self.replicas.set_ready(pool, replica, False)
        if not answers:
            raise self._unavailable(pool, "not reachable")
        return answers

    async def engine_metrics(self) -> bytes:
        """Every replica's own metrics, labelled with its pool, replica and tier (serve.engine_metrics)."""
        return await self._engine_metrics.exposition()

    async def models(self) -> list[dict[str, Any]]:
        """Each ready pool's model as its engine lists it (from one replica), by its served name;
        pools that do not answer are left out, and so are the adapters the engines list."""
        data: list[dict[str, Any]] = []
        for pool in self.pools:
            for replica in await self.replicas.ready(pool):
                try:
                    async with self._sessions[replica.name].get(
                            f"{ENGINE_BASE_URL}/v1/models", headers=self._headers, raise_for_status=True,
                            timeout=aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S)) as response:
                        listed = (await response.json(content_type=None)).get("data", [])
                    data.extend(model_entry(entry) for entry in listed
                                if isinstance(entry, dict) and entry.get("id") == pool.model)
                    break
                except (TimeoutError, aiohttp.ClientError, ValueError, AttributeError):
                    continue
        return data


# What of an engine's model object reaches clients: vLLM's `root` is the checkpoint's path, and its
# `permission` entries are made up per call.
MODEL_FIELDS = ("id", "object", "created", "owned_by", "max_model_len")


def model_entry(entry: dict[str, Any]) -> dict[str, Any]:
    """An engine's /v1/models entry with its served name as its root and nothing else of the server's."""
    kept = {name: entry[name] for name in MODEL_FIELDS if name in entry}
    return {**kept, "object": "model", "root": entry["id"], "parent": None}


async def read_answer(response: aiohttp.ClientResponse, pool: Pool) -> bytes:
    """A whole (non-streamed) answer from the engine, an error answer in OpenAI's shape
    (serve.errors.engine_error); 502 if the engine fails mid-answer."""
    try:
        content = await response.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise GatewayError(502, f"engine pool {pool.name!r} failed: {type(exc).__name__}",
                           type="upstream_error", code="engine_error") from exc
    finally:
        response.release()
    if response.status < 400:
        return content
    try:
        body = decode_json(content)
    except ValueError:
        body = None  # a plain-text error page
    return json.dumps(engine_error(response.status, body).body(), separators=(",", ":")).encode()
