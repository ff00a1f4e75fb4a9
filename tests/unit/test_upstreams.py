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

from serve.errors import GatewayError
from serve.upstream import Pool, Upstreams, engine_session


def pool_at(path: Path) -> Pool:
    return Pool(name="main", model="m", socket=path)


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
    return {pool.name: engine_session(pool, aiohttp.ClientTimeout(total=None, sock_connect=1))}


def test_a_listening_engine_that_does_not_answer_gets_no_requests(tmp_path: Path) -> None:
    starting = socket.socket(socket.AF_UNIX)
    starting.bind(str(tmp_path / "main.sock"))
    starting.listen()  # as an engine that listens and never answers
    pool = pool_at(tmp_path / "main.sock")

    async def scenario() -> GatewayError:
        [http] = (clients := sessions(pool)).values()
        async with http:
            upstreams = Upstreams([pool], clients, "key")
            await upstreams.check()  # its health check times out: not ready
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
            response = await upstreams.send(main, "/v1/chat/completions", b"{}", "r1")  # checked first
            assert response.status == 200
            response.release()
            await runner.cleanup()  # the engine dies
            with pytest.raises(GatewayError, match="not reachable") as refused:
                await upstreams.send(main, "/v1/chat/completions", b"{}", "r2")
            assert refused.value.status == 503
            with pytest.raises(GatewayError, match="not ready"):
                await upstreams.send(main, "/v1/chat/completions", b"{}", "r3")  # its health check fails
            assert await upstreams.models() == [], "a pool set aside is not asked for its models"
            path.unlink(missing_ok=True)  # as the orphans wrapper removes a dead engine's socket
            restarted = await engine(path)  # back: the next request's health check passes
            response = await upstreams.send(main, "/v1/chat/completions", b"{}", "r4")
            assert response.status == 200
            response.release()
            await restarted.cleanup()

    asyncio.run(scenario())
