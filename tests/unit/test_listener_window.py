"""The listener's receive window, on a real uvicorn server on loopback: a connection's kernel
buffer stays small until the app takes a body (so a body it refuses, or answers without reading,
is read in small pieces), and opens once the app has taken more than WIDE_AFTER of one."""

from __future__ import annotations

import platform
import socket
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
from tests.unit.test_listener import drained, serve

BODY = 4 * WIDE_AFTER


@pytest.fixture
def windows(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Each window the listener sets: the size asked for, and the kernel's buffer after it."""
    set_window = GuardedHttpToolsProtocol._set_window
    seen: list[tuple[int, int]] = []

    def noted(protocol: GuardedHttpToolsProtocol, size: int) -> None:
        set_window(protocol, size)
        sock = protocol.transport.get_extra_info("socket")
        seen.append((size, sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)))

    monkeypatch.setattr(GuardedHttpToolsProtocol, "_set_window", noted)
    return seen


@pytest.fixture
def port(windows: list[tuple[int, int]]) -> Iterator[int]:
    yield from serve(**forwarding(GatewaySettings()))


def send(port: int, path: str) -> bytes:
    connection = socket.create_connection(("127.0.0.1", port), timeout=30)
    with connection:
        connection.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                           f"Content-Length: {BODY}\r\n\r\n".encode() + b"x" * BODY)
        return drained(connection)


def test_a_body_the_app_takes_opens_the_window_and_is_read_whole(port: int, windows: list[tuple[int, int]]) -> None:
    assert send(port, "/").endswith(f"{BODY} 127.0.0.1".encode())
    assert [size for size, _ in windows] == [NARROW_WINDOW, WIDE_WINDOW]
    (_, narrow), (_, wide) = windows
    assert narrow <= 2 * NARROW_WINDOW < wide  # Linux doubles what it is asked for


def test_a_body_answered_unread_is_read_through_the_narrow_window(port: int, windows: list[tuple[int, int]]) -> None:
    """The app answers from the headers; the rest of the body is read and dropped, never opening the
    window, however large it is."""
    assert send(port, "/early").endswith(b"early")
    assert len(windows) == 1 and windows[0][0] == NARROW_WINDOW and windows[0][1] <= 2 * NARROW_WINDOW


def test_glibcs_mmap_threshold_is_fixed_where_glibc_runs() -> None:
    assert give_back_large_blocks() == (platform.libc_ver()[0] == "glibc")
