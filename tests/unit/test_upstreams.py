"""Engine readiness in the gateway's relay: no request goes to an engine that accepts
connections but does not answer, or that refused a connection; such requests get 503 once a health
check says so (never a hang), and the pool is used again once its health check passes."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

import serve.replicas as replicas_module
from appliance.settings import RoutingSettings
from serve.errors import GatewayError
from serve.replicas import Pool, Replica, engine_session
from serve.upstream import EngineGone, Upstreams


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


class StandIn:
    """An engine whose answers wait `answer_after_s` (a long prefill or generation), with a stream's
    first event sent at once; wedged, it answers nothing at all (SIGSTOP), its health check included."""

    def __init__(self, answer_after_s: float = 0.0) -> None:
        self.answer_after_s = answer_after_s
        self.wedged = False
        self.health_asked = 0

    async def _unless_wedged(self) -> None:
        while self.wedged:
            await asyncio.sleep(0.02)

    async def health(self, request: web.Request) -> web.Response:
        self.health_asked += 1
        await self._unless_wedged()
        return web.Response(text="ok")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        stream = (await request.json()).get("stream", False)
        if not stream:
            await asyncio.sleep(self.answer_after_s)
            await self._unless_wedged()
            return web.json_response({"ok": True})
        answer = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await answer.prepare(request)
        await answer.write(b'data: {"choices": []}\n\n')
        await asyncio.sleep(self.answer_after_s)
        await self._unless_wedged()
        await answer.write(b"data: [DONE]\n\n")
        return answer

    async def start(self, path: Path) -> web.AppRunner:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/chat/completions", self.chat)
        runner = web.AppRunner(app, shutdown_timeout=0.1)  # a request it still holds is dropped
        await runner.setup()
        await web.UnixSite(runner, str(path)).start()
        return runner


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica gone after 0.6 s without an answered health check (0.2 s each), so tests run fast."""
    monkeypatch.setattr(replicas_module, "NO_ANSWER_S", 0.6)
    monkeypatch.setattr(replicas_module, "HEALTH_TIMEOUT_S", 0.2)


async def watched(upstreams: Upstreams) -> asyncio.Task[None]:
    await upstreams.replicas.check()
    return asyncio.create_task(upstreams.replicas.watch(0.05))


@pytest.mark.parametrize("stream", [False, True], ids=["before-headers", "mid-stream"])
def test_a_request_on_an_engine_that_wedges_ends_and_later_ones_get_503_at_once(
        tmp_path: Path, quick: None, stream: bool) -> None:
    """The engine wedges while it holds the request (SIGSTOP: its socket takes connections, nothing
    answers): once it has not answered its health check for NO_ANSWER_S the request ends, a 503
    before the answer's headers or a cut stream after them, never a hang; requests after it get a
    503 without a health check of their own; once it answers again it takes requests again."""
    pool = pool_at(tmp_path / "main.sock")
    stand_in = StandIn(answer_after_s=3600)
    body = json.dumps({"stream": stream}).encode()

    async def scenario() -> None:
        runner = await stand_in.start(pool.replicas[0].socket)
        [http] = (clients := sessions(pool)).values()
        upstreams = Upstreams([pool], clients, "key")
        watch = await watched(upstreams)
        try:
            asking = asyncio.create_task(upstreams.send(pool, "/v1/chat/completions", body, "r1"))
            if stream:
                sent = await asking
                assert sent.response.status == 200
                assert await sent.response.content.readline() == b'data: {"choices": []}\n'
                asking = asyncio.create_task(sent.response.content.read())
            await asyncio.sleep(0.1)
            stand_in.wedged = True
            if stream:
                with pytest.raises(EngineGone):
                    await asking
                sent.done()
            else:
                with pytest.raises(GatewayError) as ended:
                    await asking
                assert ended.value.status == 503 and ended.value.code == "engine_not_answering"
            assert upstreams.balancers["main"].in_flight == {"main": 0}
            asked = stand_in.health_asked
            with pytest.raises(GatewayError) as later:
                await upstreams.send(pool, "/v1/chat/completions", b"{}", "r2")
            assert later.value.status == 503 and later.value.code == "engine_unavailable"
            assert stand_in.health_asked - asked <= 1, "at most the watch's own check: none of its own"
            stand_in.wedged, stand_in.answer_after_s = False, 0.0
            while not upstreams.replicas.is_ready(pool.replicas[0]):
                await asyncio.sleep(0.02)
            sent = await upstreams.send(pool, "/v1/chat/completions", b"{}", "r3")
            assert sent.response.status == 200 and not upstreams.replicas.gone(pool.replicas[0]).is_set()
            sent.response.release()
            sent.done()
        finally:
            watch.cancel()
            await http.close()
            await runner.cleanup()

    asyncio.run(scenario())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_long_answer_from_an_engine_that_answers_is_never_cut(tmp_path: Path, quick: None, stream: bool) -> None:
    """A long prefill or generation (the answer takes many times NO_ANSWER_S, nothing sent
    meanwhile) on an engine that answers its health check: the answer arrives whole."""
    pool = pool_at(tmp_path / "main.sock")
    stand_in = StandIn(answer_after_s=2.0)

    async def scenario() -> bytes:
        runner = await stand_in.start(pool.replicas[0].socket)
        [http] = (clients := sessions(pool)).values()
        upstreams = Upstreams([pool], clients, "key")
        watch = await watched(upstreams)
        try:
            sent = await upstreams.send(pool, "/v1/chat/completions", json.dumps({"stream": stream}).encode(), "r1")
            try:
                return await sent.response.read()
            finally:
                sent.done()
        finally:
            watch.cancel()
            await http.close()
            await runner.cleanup()

    answer = asyncio.run(scenario())
    assert answer.endswith(b"data: [DONE]\n\n" if stream else b'{"ok": true}')
