"""/admin/pools and /admin/cache (role `admin`): the engine pools with their tiers and replicas (each
one's health, requests in flight and GPUs), the routing policy, and the response cache (its size and
hit rate; flushing it)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from appliance.engine_launch import engine_program
from appliance.home import Home
from appliance.lifecycle import started_programs
from appliance.settings import RoutingSettings
from serve.audit_trail import MONITORING
from serve.deps import requires
from serve.response_cache import CacheStats
from serve.upstream import Upstreams


class ReplicaView(BaseModel):
    name: str = Field(description="Its engine: program vllm-<name>.")
    url: str
    healthy: bool = Field(description="It answers its health check now.")
    taking_requests: bool = Field(description="The router sends it requests (false: set aside until its health "
                                  "check passes).")
    in_flight: int = Field(description="Requests it is answering now.")
    gpus: list[int] = Field(description="GPU indexes its engine holds (none on the CPU engine).")


class PoolView(BaseModel):
    name: str
    model: str
    tier: str | None = Field(description="The tier of its model it serves; clients may ask for MODEL:TIER.")
    healthy: bool = Field(description="At least one replica answers.")
    replicas: list[ReplicaView]


class Routing(BaseModel):
    policy: RoutingSettings
    pools: list[PoolView]


class BalanceChange(BaseModel):
    model_config = {"extra": "forbid"}

    balance: Literal["affinity", "least_loaded", "round_robin"]


class Flushed(BaseModel):
    flushed: int = Field(description="Entries dropped.")


def router(home: Home) -> APIRouter:
    routes = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(requires("admin"))])

    @routes.get("/pools", response_model=list[PoolView], name="pools.list", openapi_extra=MONITORING)
    async def pools(request: Request) -> list[PoolView]:
        """Engine pools: the model and tier each serves, and its replicas."""
        return await _pools(request.app.state.gateway.upstreams, home)

    @routes.get("/routing", response_model=Routing, name="routing.read", openapi_extra=MONITORING)
    async def routing(request: Request) -> Routing:
        """The routing policy (tiers by request type, how replicas share requests) and the pools."""
        upstreams: Upstreams = request.app.state.gateway.upstreams
        return Routing(policy=upstreams.routing, pools=await _pools(upstreams, home))

    @routes.put("/routing/balance", response_model=RoutingSettings, name="routing.balance")
    async def balance(request: Request, change: BalanceChange) -> RoutingSettings:
        """How the replicas of every pool share requests from now on, until the gateway restarts (the
        settings file's routing.balance then applies again)."""
        upstreams: Upstreams = request.app.state.gateway.upstreams
        upstreams.set_balance(change.balance)
        return upstreams.routing

    @routes.get("/cache", response_model=CacheStats, name="cache.read", openapi_extra=MONITORING)
    async def cache(request: Request) -> CacheStats:
        """The response cache: entries, bytes, hits, misses and hit rate."""
        return request.app.state.gateway.cache.stats()  # type: ignore[no-any-return]

    @routes.post("/cache/flush", response_model=Flushed, name="cache.flush")
    async def flush(request: Request) -> Flushed:
        """Drop every cached answer."""
        return Flushed(flushed=request.app.state.gateway.cache.flush())

    return routes


async def _pools(upstreams: Upstreams, home: Home) -> list[PoolView]:
    gpus = {program.name: program.gpus for program in started_programs(home) if program.pool}
    pools = []
    for pool in upstreams.pools:
        balancer = upstreams.balancers[pool.name]
        replicas = [ReplicaView(name=replica.name, url=f"unix:{replica.socket}",
                                healthy=await upstreams.replicas.healthy(replica),
                                taking_requests=upstreams.replicas.is_ready(replica),
                                in_flight=balancer.in_flight[replica.name],
                                gpus=gpus.get(engine_program(replica.name), [])) for replica in pool.replicas]
        pools.append(PoolView(name=pool.name, model=pool.model, tier=pool.tier,
                          healthy=any(replica.healthy for replica in replicas), replicas=replicas))
    return pools
