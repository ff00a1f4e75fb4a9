"""A real gateway (serve.listener over HTTPS with a public URL, a state directory of its own,
Keycloak's port closed: a refused body never needs it) refuses a body past a published login
route's bound from what it has: a client that sends its headers with Content-Length: 1 MB and then
nothing gets its 413, a chunked body gets it once past the bound, and a flood of anonymous 1 MB
bodies is answered 413 every one (the TLS layer reads the rest of each body through the narrow
window and closes after the answer is out)."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from appliance.home import HOME_ENV, Home
from appliance.tls import ca_file, ensure_ca
from tests.support.ports import free_port

REALM = "/realms/appliance"
POSTS = {"protocol/openid-connect/token": 16384, "protocol/openid-connect/auth/device": 4096,
         "protocol/openid-connect/revoke": 16384, "device": 4096, "login-actions/authenticate": 8192}


@dataclass
class Gateway:
    port: int
    tls: ssl.SSLContext

    def connect(self) -> ssl.SSLSocket:
        raw = socket.create_connection(("127.0.0.1", self.port), timeout=60)
        return self.tls.wrap_socket(raw, server_hostname="127.0.0.1")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    home = Home(tmp_path_factory.mktemp("gateway")).ensure()
    ensure_ca(home)
    port = free_port()
    url = f"https://127.0.0.1:{port}"
    env = {**os.environ, HOME_ENV: str(home.root), "APPLIANCE_GATEWAY__PORT": str(port),
           "APPLIANCE_GATEWAY__TLS": "on", "APPLIANCE_GATEWAY__PUBLIC_URL": url,
           "APPLIANCE_GATEWAY__LOGIN_BURST": "10000", "APPLIANCE_GATEWAY__LOGIN_ATTEMPTS_PER_MINUTE": "6000",
           "APPLIANCE_KEYCLOAK__EVENTS_POLL_S": "0", "APPLIANCE_KEYCLOAK__PORT": str(free_port())}
    process = subprocess.Popen([sys.executable, "-m", "serve.listener"], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    tls = ssl.create_default_context(cafile=str(ca_file(home)))
    deadline = time.monotonic() + 120
    try:
        while True:
            try:
                httpx.get(f"{url}/healthz", timeout=1, verify=tls).raise_for_status()
                break
            except httpx.HTTPError:
                assert process.poll() is None and time.monotonic() < deadline, f"the gateway did not start ({home})"
                time.sleep(0.2)
        yield Gateway(port, tls)
    finally:
        process.terminate()
        process.wait(30)


def answer(connection: ssl.SSLSocket) -> tuple[int, bytes]:
    """The response's status and head, read to the end of the connection (the gateway closes it)."""
    received = b""
    try:
        while chunk := connection.recv(65536):
            received += chunk
    except (ConnectionResetError, ssl.SSLEOFError):
        pass
    head = received.split(b"\r\n\r\n", 1)[0]
    return int(head.split(b" ", 2)[1]), head.lower()


def head(path: str, framing: str) -> bytes:
    return (f"POST {REALM}/{path}?client_id=appliance-cli HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/x-www-form-urlencoded\r\n{framing}\r\n\r\n").encode()


@pytest.mark.parametrize("path", sorted(POSTS))
def test_headers_alone_past_the_bound_get_their_413(gateway: Gateway, path: str) -> None:
    """Content-Length: 1 MB and not a byte of the body: the 413 comes from the headers, and the
    connection closes."""
    with gateway.connect() as connection:
        connection.sendall(head(path, "Content-Length: 1000000"))
        status, got = answer(connection)
    assert status == 413 and b"connection: close" in got


@pytest.mark.parametrize("path", sorted(POSTS))
def test_a_chunked_body_is_refused_once_past_the_bound(gateway: Gateway, path: str) -> None:
    """4 KiB chunks up to one past the bound, and then nothing (no last chunk): a 413."""
    chunks = b"".join(b"1000\r\n" + b"a" * 4096 + b"\r\n" for _ in range(POSTS[path] // 4096 + 1))
    with gateway.connect() as connection:
        connection.sendall(head(path, "Transfer-Encoding: chunked") + chunks)
        status, got = answer(connection)
    assert status == 413 and b"connection: close" in got


def test_a_flood_of_anonymous_bodies_is_answered_413_every_one(gateway: Gateway) -> None:
    body = b"grant_type=password&client_id=appliance-cli&username=admin&password=" + b"x" * 1_000_000

    async def flood() -> list[int]:
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
        async with httpx.AsyncClient(verify=gateway.tls, timeout=120, limits=limits) as http:
            answers = await asyncio.gather(*(
                http.post(f"https://127.0.0.1:{gateway.port}{REALM}/protocol/openid-connect/token", content=body,
                          headers={"content-type": "application/x-www-form-urlencoded"}) for _ in range(100)))
        return [answer.status_code for answer in answers]

    assert asyncio.run(flood()) == [413] * 100
    assert httpx.get(f"https://127.0.0.1:{gateway.port}/healthz", verify=gateway.tls, timeout=30).status_code == 200

