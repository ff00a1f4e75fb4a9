"""The engines behind the gateway: the pools and their replicas, and which replicas answer.

A replica is sent requests only while it is known to answer. Until its health check passes, and
again after it refused or dropped a connection (it died), it is set aside; `watch` checks every
replica each second, so one that restarts returns by itself (and one that died is set aside before
a request finds it gone). An engine that accepts connections but does not answer (still loading
behind an open port, or wedged) would otherwise hold a request for as long as it stays so:
generation has no time limit. vLLM itself binds its port early but listens only once it serves,
so while it restarts its connections are refused.
"""

from __future__ import annotations

import asyncio
import logging
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
        for pool in pools:
            for replica in pool.replicas:
                self.metrics.replica_ready.labels(pool.name, replica.name).set(0)

    def is_ready(self, replica: Replica) -> bool:
        return self._ready[replica.name]

    def set_ready(self, pool: Pool, replica: Replica, ready: bool) -> None:
        self._ready[replica.name] = ready
        self.metrics.replica_ready.labels(pool.name, replica.name).set(1 if ready else 0)

    def set_aside(self, pool: Pool, replica: Replica, why: BaseException) -> None:
        """No more requests to `replica` until its health check passes."""
        self.set_ready(pool, replica, False)
        log.warning("engine %s set aside until its health check passes: %s", replica.name, type(why).__name__)

    async def healthy(self, replica: Replica) -> bool:
        """Whether the replica's engine answers its health check now."""
        try:
            async with self._sessions[replica.name].get(f"{ENGINE_BASE_URL}/health",
                                                        timeout=aiohttp.ClientTimeout(total=2.0)) as response:
                return response.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def probe(self, pool: Pool, replica: Replica) -> bool:
        """Whether the replica answers, checking its health if it is not known to. A pool spanning
        hosts answers only while its controller says every rank is up (a rank elsewhere that
        died leaves the head's engine answering /health until a request fails)."""
        if pool.cluster_state is not None:
            state = read_cluster_state(pool.cluster_state)
            if state is None or not state.ready:
                self.set_ready(pool, replica, False)
                return False
        if self._ready[replica.name]:
            return True
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
        """Check the health of every replica: one that stopped answering is set aside even before a
        request finds it gone; one set aside returns once it answers."""
        for pool in self.pools:
            for replica in pool.replicas:
                if self._ready[replica.name] and pool.cluster_state is None and not await self.healthy(replica):
                    self.set_aside(pool, replica, TimeoutError("no answer to its health check"))
                await self.probe(pool, replica)

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
