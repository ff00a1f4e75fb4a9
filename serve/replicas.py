"""The engines behind the gateway: the pools and their replicas, and which replicas answer.

A replica is sent requests only while it is known to answer. Until its health check passes, and
again after it refused or dropped a connection (it died) or its health check failed, it is set
aside; `watch` checks every replica each second, all at once, so one that restarts returns by
itself (and one that died is set aside before a request finds it gone). While a replica is set
aside, a request asks its health itself (a refused connection costs nothing) unless its last check
timed out less than RECHECK_S ago: a wedged engine (SIGSTOP, a deadlock) costs a request a 503 at
once, not a health check's timeout.

An engine that accepts connections but does not answer (wedged: its socket's backlog takes them)
would hold a request for as long as it stays so, since generation has no time limit and a long
prompt's prefill sends nothing for a while. Requests are therefore bounded by the replica's
progress, not by their duration: a replica not heard from (no health check answered) for
NO_ANSWER_S is `gone`, and the requests in flight on it end (serve.upstream: a 503 before the
answer's headers, the stream cut after). vLLM answers its health check from its API server while
its engine computes, so a long prefill or generation keeps it heard from. An engine whose API
server answers while its engine core makes no progress is the watchdog's (serve.watchdog). vLLM
itself binds its port early but listens only once it serves, so while it restarts its connections
are refused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from appliance.engine_launch import engine_socket, pool_layout, replica_names
from appliance.home import Home
from appliance.hosts import cluster_state_file, read_cluster_state
from appliance.model_refs import served_name, tiers_of_models
from appliance.settings import Settings
from serve.engine import ENGINE_BASE_URL
from serve.metrics import Metrics

log = logging.getLogger("appliance.gateway")
WATCH_INTERVAL_S = 1.0
# How long a pool spanning hosts that failed a request waits for its controller's verdict: a rank
# elsewhere that died fails the head's next step before the controller hears of it.
CLUSTER_VERDICT_S = 1.0
ENGINE_KEEPALIVE_S = 4.0
HEALTH_TIMEOUT_S = 2.0
# A replica whose health check has not answered for this long is gone: its requests end. Several
# checks (each up to HEALTH_TIMEOUT_S) fail first, so a slow answer under load is not taken for it.
NO_ANSWER_S = 10.0
RECHECK_S = 3.0  # a request asks a replica set aside for its health only once its last timed-out check is this old


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


class ReplicaSet:
    """Which of the pools' replicas answer: each known to, or set aside until its health check
    passes (one check at a time per replica, shared by the requests waiting). A pool spanning
    hosts answers only while its controller says every rank is up."""

    def __init__(self, pools: list[Pool], sessions: Mapping[str, aiohttp.ClientSession], metrics: Metrics) -> None:
        self.pools = pools
        self.metrics = metrics
        self._sessions = sessions  # by replica name: each reaches its engine's socket
        replicas = [replica for pool in pools for replica in pool.replicas]
        self._ready = {replica.name: False for replica in replicas}
        self._probing = {replica.name: asyncio.Lock() for replica in replicas}
        now = time.monotonic()
        self._heard_at = dict.fromkeys(self._ready, now)  # its last health check answered (monotonic)
        self._timed_out_at = dict.fromkeys(self._ready, -RECHECK_S)  # its last health check timed out
        # Set once the replica is not heard from for NO_ANSWER_S; a fresh one each time it takes requests again.
        self._gone = {name: asyncio.Event() for name in self._ready}
        for pool in pools:
            for replica in pool.replicas:
                self.metrics.replica_ready.labels(pool.name, replica.name).set(0)

    def is_ready(self, replica: Replica) -> bool:
        return self._ready[replica.name]

    def gone(self, replica: Replica) -> asyncio.Event:
        """Set once `replica`, as it is now, stops answering for NO_ANSWER_S: its requests in flight end."""
        return self._gone[replica.name]

    def set_ready(self, pool: Pool, replica: Replica, ready: bool) -> None:
        if ready and self._gone[replica.name].is_set():
            self._gone[replica.name] = asyncio.Event()
        self._ready[replica.name] = ready
        self.metrics.replica_ready.labels(pool.name, replica.name).set(1 if ready else 0)

    def set_aside(self, pool: Pool, replica: Replica, why: BaseException) -> None:
        """No more requests to `replica` until its health check passes."""
        self.set_ready(pool, replica, False)
        log.warning("engine %s set aside until its health check passes: %s", replica.name, type(why).__name__)

    async def healthy(self, replica: Replica) -> bool:
        """Whether the replica's engine answers its health check now (remembered either way)."""
        try:
            async with self._sessions[replica.name].get(
                    f"{ENGINE_BASE_URL}/health", timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as response:
                answered = response.status == 200
        except TimeoutError:
            self._timed_out_at[replica.name] = time.monotonic()
            return False
        except aiohttp.ClientError:
            return False
        if answered:
            self._heard_at[replica.name] = time.monotonic()
        return answered

    async def probe(self, pool: Pool, replica: Replica, *, recheck: bool = False) -> bool:
        """Whether the replica answers, checking its health if it is not known to (unless a check
        timed out less than RECHECK_S ago, and not `recheck`). A pool spanning hosts answers only while its
        controller says every rank is up (a rank elsewhere that died leaves the head's engine
        answering /health until a request fails)."""
        if pool.cluster_state is not None:
            state = read_cluster_state(pool.cluster_state)
            if state is None or not state.ready:
                self.set_ready(pool, replica, False)
                return False
        if self._ready[replica.name]:
            return True
        if not recheck and time.monotonic() - self._timed_out_at[replica.name] < RECHECK_S:
            return False  # the watch checks it again within the second
        async with self._probing[replica.name]:
            if not self._ready[replica.name] and await self.healthy(replica):
                self.set_ready(pool, replica, True)
                log.warning("engine %s takes requests", replica.name)
        return self._ready[replica.name]

    async def ready(self, pool: Pool, excluded: Collection[str] = ()) -> list[Replica]:
        """The pool's replicas known to answer; when none is, each checked first (a spanning pool's
        controller is asked every time)."""
        candidates = [replica for replica in pool.replicas if replica.name not in excluded]
        ready = [replica for replica in candidates if self._ready[replica.name]]
        if not ready or pool.cluster_state is not None:
            ready = [replica for replica in candidates if await self.probe(pool, replica)]
        return ready

    async def check(self) -> None:
        """Check the health of every replica at once: one that stopped answering is set aside even
        before a request finds it gone, and its requests end once it is gone; one set aside returns
        once it answers."""
        await asyncio.gather(*(self._check(pool, replica) for pool in self.pools for replica in pool.replicas))

    async def _check(self, pool: Pool, replica: Replica) -> None:
        if self._ready[replica.name] and pool.cluster_state is None:
            if not await self.healthy(replica):
                self.set_aside(pool, replica, TimeoutError("no answer to its health check"))
        else:
            await self.probe(pool, replica, recheck=True)
        silent_s = time.monotonic() - self._heard_at[replica.name]
        if not self._ready[replica.name] and silent_s >= NO_ANSWER_S and not self._gone[replica.name].is_set():
            self._gone[replica.name].set()
            log.warning("engine %s has not answered for %.0f s: its requests in flight end", replica.name, silent_s)

    async def watch(self, interval_s: float = WATCH_INTERVAL_S) -> None:
        while True:
            await self.check()
            await asyncio.sleep(interval_s)

    async def cluster_failed(self, pool: Pool) -> bool:
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
