"""Engine readiness in the gateway's relay: no request goes to an engine that accepts
connections but does not answer, or that refused a connection; such requests get 503 once a health
check says so (never a hang), and the pool is used again once its health check passes."""

from __future__ import annotations

import asyncio
import socket
import time

import aiohttp
import pytest
from aiohttp import web

from serve.errors import GatewayError
from serve.upstream import Pool, Upstreams


def pool_at(port: int) -> Pool:
    return Pool(name="main", model="m", base_url=f"http://127.0.0.1:{port}")


async def engine(port: int = 0) -> web.AppRunner:
    """A stand-in engine: /health and an echoing chat route."""
    app = web.Application()
    app.router.add_get("/health", lambda request: web.Response(text="ok"))
    app.router.add_post("/v1/chat/completions", lambda request: web.json_response({"ok": True}))
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def port_of(runner: web.AppRunner) -> int:
    return runner.addresses[0][1]


def test_a_listening_engine_that_does_not_answer_gets_no_requests() -> None:
    starting = socket.socket()
    starting.bind(("127.0.0.1", 0))
    starting.listen()  # as a restarting vLLM does long before it answers

    async def scenario() -> GatewayError:
        async with aiohttp.ClientSession() as http:
            upstreams = Upstreams([pool_at(starting.getsockname()[1])], http, "key")
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


def test_a_pool_that_refuses_is_set_aside_until_its_health_passes() -> None:
    async def scenario() -> None:
        runner = await engine()
        port = port_of(runner)
        async with aiohttp.ClientSession() as http:
            upstreams = Upstreams([pool_at(port)], http, "key")
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
            restarted = await engine(port)  # back: the next request's health check passes
            response = await upstreams.send(main, "/v1/chat/completions", b"{}", "r4")
            assert response.status == 200
            response.release()
            await restarted.cleanup()

    asyncio.run(scenario())
