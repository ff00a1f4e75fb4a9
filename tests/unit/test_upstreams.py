"""Engine readiness in the gateway's relay: no request goes to an engine that accepts
connections but does not answer, or that refused a connection; such requests get 503 once a health
check says so (never a hang), and the pool is used again once its health check passes."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from appliance.settings import RoutingSettings
from serve.errors import GatewayError
from serve.replicas import Pool, Replica, engine_session
from serve.upstream import Upstreams


def pool_at(path: Path) -> Pool:
    return Pool(name="main", model="m", replicas=(Replica("main", path),))


async def engine(path: Path) -> web.AppRunner:
    """A stand-in engine on a Unix socket: /health and an echoing chat route."""
    app = web.Application()
    app.router.add_get("/health", lambda request: web.Response(text="ok"))
    app.router.add_post("/v1/chat/completions", lambda request: web.json_response({"ok": True}))
    runner = web.AppRunner(app)
    await runner.setup()
    await web.UnixSite(runner, str(path)).start()
    return runner


def sessions(pool: Pool) -> dict[str, aiohttp.ClientSession]:
    return {replica.name: engine_session(replica, aiohttp.ClientTimeout(total=None, sock_connect=1))
            for replica in pool.replicas}


def test_a_listening_engine_that_does_not_answer_gets_no_requests(tmp_path: Path) -> None:
    starting = socket.socket(socket.AF_UNIX)
    starting.bind(str(tmp_path / "main.sock"))
    starting.listen()  # as an engine that listens and never answers
    pool = pool_at(tmp_path / "main.sock")

    async def scenario() -> GatewayError:
        [http] = (clients := sessions(pool)).values()
        async with http:
            upstreams = Upstreams([pool], clients, "key")
            await upstreams.replicas.check()  # its health check times out: not ready
            asked = time.monotonic()
            with pytest.raises(GatewayError) as refused:
                await upstreams.send(upstreams.pools[0], "/v1/chat/completions", b"{}", "r1")
            assert time.monotonic() - asked < 10, "503 after a health check (2 s at most), not a hang"
            return refused.value

    try:
        refused = asyncio.run(scenario())
    finally:
        starting.close()
    assert refused.status == 503 and refused.code == "engine_unavailable" and refused.headers["Retry-After"]


def test_a_pool_that_refuses_is_set_aside_until_its_health_passes(tmp_path: Path) -> None:
    path = tmp_path / "main.sock"
    pool = pool_at(path)

    async def scenario() -> None:
        runner = await engine(path)
        [http] = (clients := sessions(pool)).values()
        async with http:
            upstreams = Upstreams([pool], clients, "key")
            main = upstreams.pools[0]
            sent = await upstreams.send(main, "/v1/chat/completions", b"{}", "r1")  # checked first
            assert sent.response.status == 200
            sent.response.release()
            sent.done()
            await runner.cleanup()  # the engine dies
            with pytest.raises(GatewayError, match="not reachable") as refused:
                await upstreams.send(main, "/v1/chat/completions", b"{}", "r2")
            assert refused.value.status == 503
            with pytest.raises(GatewayError, match="not ready"):
                await upstreams.send(main, "/v1/chat/completions", b"{}", "r3")  # its health check fails
            assert await upstreams.models() == [], "a pool set aside is not asked for its models"
            path.unlink(missing_ok=True)  # as the orphans wrapper removes a dead engine's socket
            restarted = await engine(path)  # back: the next request's health check passes
            sent = await upstreams.send(main, "/v1/chat/completions", b"{}", "r4")
            assert sent.response.status == 200
            sent.response.release()
            sent.done()
            await restarted.cleanup()

    asyncio.run(scenario())


def test_a_replica_that_dies_is_routed_around_and_returns_by_itself(tmp_path: Path) -> None:
    """With two replicas, a request finding one dead goes to the other at once (failover),
    the dead one is set aside, and once its health passes again it takes requests again."""
    replicas = (Replica("main", tmp_path / "a.sock"), Replica("main_1", tmp_path / "b.sock"))
    pool = Pool(name="main", model="m", replicas=replicas)

    async def scenario() -> None:
        runners = {r.name: await engine(r.socket) for r in replicas}
        clients = sessions(pool)
        upstreams = Upstreams([pool], clients, "key", RoutingSettings(balance="round_robin"))
        try:
            await upstreams.replicas.check()
            assert sorted(await answered_by(upstreams, pool, 4)) == ["main", "main", "main_1", "main_1"]
            await runners["main"].cleanup()  # replica 0 dies
            assert await answered_by(upstreams, pool, 4) == ["main_1"] * 4
            assert not upstreams.replicas.is_ready(replicas[0])
            choices = upstreams.metrics.route_choices
            assert choices.labels("main", "main_1", "failover")._value.get() == 1
            replicas[0].socket.unlink(missing_ok=True)
            runners["main"] = await engine(replicas[0].socket)
            await upstreams.replicas.check()  # as the watch loop does every second
            assert upstreams.replicas.is_ready(replicas[0])
            assert "main" in await answered_by(upstreams, pool, 2)
            assert upstreams.balancers["main"].in_flight == {"main": 0, "main_1": 0}
        finally:
            for client in clients.values():
                await client.close()
            for runner in runners.values():
                await runner.cleanup()

    asyncio.run(scenario())


async def answered_by(upstreams: Upstreams, pool: Pool, requests: int) -> list[str]:
    """The replica that answered each of `requests` requests (each answered 200)."""
    replicas = []
    for index in range(requests):
        sent = await upstreams.send(pool, "/v1/chat/completions", b"{}", f"r{index}")
        assert sent.response.status == 200
        replicas.append(sent.replica.name)
        sent.response.release()
        sent.done()
    return replicas
