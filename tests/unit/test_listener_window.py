"""The listener's receive window, on a real uvicorn server on loopback: a connection's kernel
buffer is small from its first segment (the listening socket's, inherited) until the app takes a
body (so a body it refuses, or answers without reading, is read in small pieces), and opens once
the app has taken more than WIDE_AFTER of one; a body sent at full speed loses no segment on the
way (narrowing a window once advertised made the kernel drop them, and the client wait out
retransmission timeouts)."""

from __future__ import annotations

import platform
import socket
import struct
from collections.abc import Iterator

import pytest

from appliance.settings import GatewaySettings
from serve.listener import (
    NARROW_WINDOW,
    WIDE_AFTER,
    WIDE_WINDOW,
    GuardedHttpToolsProtocol,
    forwarding,
    give_back_large_blocks,
)
from tests.unit.test_listener import serve

BODY = 4 * WIDE_AFTER


TCPI_TOTAL_RETRANS = 100  # struct tcp_info's offset of tcpi_total_retrans (linux/tcp.h), a u32


@pytest.fixture
def windows(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """A connection's window as accepted (asked for: 0), then each window the listener sets: the size
    asked for, and the kernel's buffer after it."""
    set_window, made = GuardedHttpToolsProtocol._set_window, GuardedHttpToolsProtocol.connection_made
    seen: list[tuple[int, int]] = []

    def buffer(protocol: GuardedHttpToolsProtocol) -> int:
        return int(protocol.transport.get_extra_info("socket").getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))

    def accepted(protocol: GuardedHttpToolsProtocol, transport: object) -> None:
        made(protocol, transport)  # type: ignore[arg-type]
        seen.append((0, buffer(protocol)))

    def noted(protocol: GuardedHttpToolsProtocol, size: int) -> None:
        set_window(protocol, size)
        seen.append((size, buffer(protocol)))

    monkeypatch.setattr(GuardedHttpToolsProtocol, "connection_made", accepted)
    monkeypatch.setattr(GuardedHttpToolsProtocol, "_set_window", noted)
    return seen


@pytest.fixture
def port(windows: list[tuple[int, int]]) -> Iterator[int]:
    yield from serve(**forwarding(GatewaySettings()))


def send(port: int, path: str, answer_ends: bytes) -> tuple[bytes, int]:
    """The answer to a POST of BODY bytes sent at once, read up to its known end (a server closing
    on a body it left unread may reset the connection after it), and the segments the client had
    to send again."""
    connection = socket.create_connection(("127.0.0.1", port), timeout=30)
    with connection:
        connection.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                           f"Content-Length: {BODY}\r\n\r\n".encode() + b"x" * BODY)
        answer = b""
        while not answer.endswith(answer_ends):
            chunk = connection.recv(4096)
            assert chunk, f"closed before the answer's end: {answer!r}"
            answer += chunk
        info = connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCPI_TOTAL_RETRANS + 4)
        return answer, struct.unpack_from("I", info, TCPI_TOTAL_RETRANS)[0]


def test_a_body_the_app_takes_opens_the_window_and_is_read_whole(port: int, windows: list[tuple[int, int]]) -> None:
    answer, resent = send(port, "/", f"{BODY} 127.0.0.1".encode())
    assert [size for size, _ in windows] == [0, WIDE_WINDOW]
    (_, narrow), (_, wide) = windows
    assert narrow <= 2 * NARROW_WINDOW < wide  # Linux doubles what it is asked for
    assert resent == 0, "the kernel dropped segments the window had let in"


def test_a_body_answered_unread_is_read_through_the_narrow_window(port: int, windows: list[tuple[int, int]]) -> None:
    """The app answers from the headers; the rest of the body is read and dropped, never opening the
    window, however large it is."""
    answer, resent = send(port, "/early", b"early")
    assert len(windows) == 1 and windows[0][0] == 0 and windows[0][1] <= 2 * NARROW_WINDOW
    assert resent == 0, "the kernel dropped segments the window had let in"


def test_glibcs_mmap_threshold_is_fixed_where_glibc_runs() -> None:
    assert give_back_large_blocks() == (platform.libc_ver()[0] == "glibc")
