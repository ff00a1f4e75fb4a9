"""The listener's guards, on a real uvicorn server on loopback: a body that stalls or trickles is
closed at its deadline and reported; one that keeps the minimum rate is read whole; forwarded
headers are believed only from the proxies named."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from starlette.requests import Request
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from appliance.settings import GatewaySettings
from serve.listener import GuardedHttpToolsProtocol, bind, forwarding
from serve.slow_clients import SlowClients
from tests.support.ports import free_port
from tests.support.waiting import until


async def echo(scope: Scope, receive: Receive, send: Send) -> None:
    """The body's length and the client's address, as the app sees it; 4 MiB at /big, in pieces."""
    if scope["path"] == "/early":  # answers before reading the body, as a refusal by headers does
        await PlainTextResponse("early")(scope, receive, send)
        return
    if scope["path"] == "/slow":  # an answer that takes three body deadlines: the slowness under test
        await asyncio.sleep(1.5)
    request = Request(scope, receive)
    body = await request.body()
    if scope["path"] == "/big":
        await StreamingResponse(b"x" * 65536 for _ in range(64))(scope, receive, send)
    else:
        await PlainTextResponse(f"{len(body)} {scope['client'][0]}")(scope, receive, send)


def serve(**config: object) -> Iterator[int]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(echo, host="127.0.0.1", port=port, http=GuardedHttpToolsProtocol,
                                           log_level="warning", lifespan="off", **config))  # type: ignore[arg-type]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [bind(server.config)]}, daemon=True)
    thread.start()
    until(lambda: server.started, "the server to start", 10, interval_s=0.01)
    yield port
    server.should_exit = True
    thread.join(10)


@pytest.fixture
def reported(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str | None]]:
    closed: list[tuple[str, str | None]] = []
    monkeypatch.setattr(SlowClients, "closed", lambda reason, peer: closed.append((reason, peer)))
    monkeypatch.setattr(GuardedHttpToolsProtocol, "body_timeout_s", 0.5)
    monkeypatch.setattr(GuardedHttpToolsProtocol, "body_min_rate", 100.0)
    monkeypatch.setattr(GuardedHttpToolsProtocol, "send_timeout_s", 0.5)
    return closed


@pytest.fixture
def port(reported: list) -> Iterator[int]:
    yield from serve(**forwarding(GatewaySettings()))


def post(port: int, length: int) -> socket.socket:
    connection = socket.create_connection(("127.0.0.1", port), timeout=10)
    connection.sendall(f"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode())
    return connection


def drained(connection: socket.socket) -> bytes:
    received = b""
    while chunk := connection.recv(4096):
        received += chunk
    return received


def test_a_stalled_body_is_closed_and_reported(port: int, reported: list) -> None:
    """Closed at its deadline (0.5 s, and 0.1 s for the 10 bytes), not before: a lower bound timed
    from before the headers left, which a loaded host only lengthens; no upper one (the close is
    awaited, the socket's timeout only bounds a hang)."""
    asked = time.monotonic()
    connection = post(port, 100)
    connection.sendall(b"x" * 10)
    assert drained(connection) == b"", "closed without an answer"
    assert time.monotonic() - asked >= 0.5, "closed before its body's deadline"
    assert until(lambda: reported, "the close to be reported") == [("body", "127.0.0.1")]


def test_a_trickled_body_is_closed_once_behind_the_minimum_rate(port: int, reported: list) -> None:
    """100 bytes a second buy a second each: 1 byte every 0.2 s (the trickle under test) falls
    behind, and the connection is closed while the client still trickles, its body far from whole."""
    connection = post(port, 1000)
    sent = 0
    with pytest.raises(OSError):
        while sent < 1000:
            connection.sendall(b"x")
            sent += 1
            time.sleep(0.2)
            if connection.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b"":
                raise ConnectionResetError
    assert sent < 1000, "the whole body was sent"
    assert until(lambda: reported, "the close to be reported") == [("body", "127.0.0.1")]


def test_a_body_at_the_minimum_rate_is_read_whole(port: int, reported: list) -> None:
    """300 bytes, 100 every 0.6 s (the pace under test): past the 0.5 s grace, each 100 bytes buy a
    second more."""
    connection = post(port, 300)
    for _ in range(3):
        connection.sendall(b"x" * 100)
        time.sleep(0.6)
    assert drained_answer(connection).endswith(b"300 127.0.0.1")
    assert reported == []


def drained_answer(connection: socket.socket, source: str = "127.0.0.1") -> bytes:
    connection.settimeout(10)
    received = b""
    while not received.endswith(source.encode()):
        chunk = connection.recv(4096)
        assert chunk, f"closed early: {received!r}"
        received += chunk
    return received


def test_an_idle_kept_alive_connection_is_closed_quietly(reported: list, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(GuardedHttpToolsProtocol, "header_timeout_s", 0.3)
    for port in serve(**forwarding(GatewaySettings())):
        connection = post(port, 0)
        drained_answer(connection)
        assert drained(connection) == b""  # the header deadline of the next request
        slow = socket.create_connection(("127.0.0.1", port), timeout=10)
        slow.sendall(b"GET / HTTP/1.1\r\n")
        assert drained(slow) == b""
    assert reported == [("headers", "127.0.0.1")], "only the one that began a request"


@pytest.mark.parametrize(("trusted", "source"), [([], "127.0.0.1"), (["10.0.0.0/8"], "127.0.0.1"),
                                                 (["127.0.0.1"], "203.0.113.9")])
def test_forwarded_for_is_believed_only_from_a_trusted_proxy(reported: list, trusted: list[str],
                                                              source: str) -> None:
    """The settings as the listener hands them to uvicorn (which, left alone, trusts loopback)."""
    for port in serve(**forwarding(GatewaySettings(trusted_proxies=trusted))):
        connection = socket.create_connection(("127.0.0.1", port), timeout=10)
        connection.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nX-Forwarded-For: 203.0.113.9\r\nContent-Length: 0\r\n\r\n")
        assert drained_answer(connection, source).endswith(f"0 {source}".encode())


def reported_within(reported: list, wanted: tuple[str, str | None], seconds: float = 10) -> None:
    until(lambda: wanted in reported, lambda: f"{wanted} reported; reported: {reported}", seconds)


def test_a_client_that_leaves_its_responses_unread_is_closed(port: int, reported: list) -> None:
    """Pipelined requests for a large answer, never read: the send buffer fills and stays full."""
    connection = socket.socket()
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    connection.connect(("127.0.0.1", port))
    connection.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n" * 4)
    reported_within(reported, ("response", "127.0.0.1"))
    connection.close()


def test_more_pipelined_requests_than_allowed_close_the_connection(port: int, reported: list) -> None:
    connection = socket.create_connection(("127.0.0.1", port), timeout=10)
    connection.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n" * 40)
    reported_within(reported, ("pipelined", "127.0.0.1"))
    connection.close()


def test_past_the_cap_a_new_connection_is_refused_when_none_can_be_closed(
        reported: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both connections the cap allows are being answered (their clients read slowly), so none
    waits for headers or a body: the newcomer is closed, not the cap passed."""
    monkeypatch.setattr(GuardedHttpToolsProtocol, "max_connections", 2)
    monkeypatch.setattr(GuardedHttpToolsProtocol, "send_timeout_s", 30.0)
    for port in serve(**forwarding(GatewaySettings())):
        held = []
        for _ in range(2):
            connection = socket.socket()
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
            connection.connect(("127.0.0.1", port))
            connection.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
            held.append(connection)
        for connection in held:  # each is being answered: past its headers and its body
            connection.settimeout(10)
            assert connection.recv(1, socket.MSG_PEEK) == b"H"
        extra = socket.create_connection(("127.0.0.1", port), timeout=10)
        reported_within(reported, ("over_cap", "127.0.0.1"))
        assert drained(extra) == b""
        for connection in held:
            connection.close()


def test_a_request_answered_before_its_body_arrived_leaves_no_deadline_behind(port: int, reported: list) -> None:
    """The first request is answered before its body is in; the body follows, then a request
    whose answer takes three body deadlines: the connection stays, nothing is reported."""
    connection = socket.create_connection(("127.0.0.1", port), timeout=10)
    connection.sendall(b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n")
    assert drained_answer(connection, "early").endswith(b"early")
    connection.sendall(b"x" * 10 + b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nab")
    assert drained_answer(connection).endswith(b"2 127.0.0.1")
    assert reported == []
