"""The gateway's listener: uvicorn (httptools) guarded against connection floods and slow clients.

uvicorn itself never times out a connection that opens and sends its request headers or its body
slowly or not at all, and accepts connections until the process runs out of file descriptors;
then no one gets in. Here:
- a connection must complete its request headers within `gateway.header_timeout_s` of opening
  (or of its previous response ending) or it is closed;
- a request body must arrive within `gateway.body_timeout_s` of its headers, plus a second for
  every `gateway.body_min_rate` bytes it has delivered (Apache's mod_reqtimeout rule), or the
  connection is closed: a body that stalls or trickles cannot hold it;
- a response must be read: a connection whose client leaves its responses unread (the send
  buffer full) for `gateway.send_timeout_s` is closed, and one that queues more than
  MAX_PIPELINED requests behind the one being answered is closed too;
- past `gateway.max_connections` open connections, the oldest one still sending its headers (or,
  if none is, its body) is closed to make room, and if there is none the new one is: the cap
  holds whatever the connections are doing;
- each connection closed for slowness is reported (`SlowClients`): the gateway counts it in
  /metrics and summarises it in the audit log by source; an idle kept-alive connection reaching
  the header timeout is not a slow client and is closed quietly;
- forwarded headers (X-Forwarded-For) are believed only from `gateway.trusted_proxies`, so a
  request's recorded source is its peer unless the operator named a proxy;
- served on a network address, it speaks HTTPS only (serve.https: the certificates, renewed and
  swapped in while it serves);
- the process raises its file-descriptor limit to the hard limit (supervisord's `minfds` raises
  that of every program it runs), so the cap, not the limit, decides;
- a connection's kernel receive buffer stays small (NARROW_WINDOW) until the app has taken more
  than WIDE_AFTER bytes of a request body (set on the listening socket, which every connection
  inherits: see `bind`), and its TLS layer pauses reading past
  TLS_READ_HIGH_WATER: uvloop's TLS layer reads whatever the kernel holds (up to 256 KiB a read)
  into a buffer of the connection's own and decrypts it into another, also while it discards the
  body of a request answered from its headers (a 401, a 413) before closing, so with the kernel's
  autotuned buffer a flood of anonymous bodies held about 0.6 MiB a connection; a body the app
  takes is read with the kernel's largest window;
- blocks of 128 KiB or more are mapped on their own and given back to the system when freed
  (`give_back_large_blocks`).

supervisord runs `python -m serve.listener`.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import itertools
import logging
import resource
import signal
import socket
import sys
from typing import Any, ClassVar

import uvicorn
import uvloop
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from appliance.home import Home
from appliance.settings import GatewaySettings, load_settings
from serve.https import GatewayTLS, quiet_undecodable_names
from serve.slow_clients import SlowClients

log = logging.getLogger("appliance.gateway")
FD_RESERVE = 128  # descriptors kept for the log, engines, Keycloak and the audit writer
MAX_PIPELINED = 16  # requests a connection may queue behind the one being answered
NARROW_WINDOW = 16384  # SO_RCVBUF of a connection until the app takes a body (Linux doubles it)
WIDE_AFTER = 262144  # body bytes received for one request (the app took most: uvicorn stops at 64 KiB unread)
WIDE_WINDOW = 1 << 30  # SO_RCVBUF once it has: the kernel caps it at net.core.rmem_max
TLS_READ_HIGH_WATER = 65536  # bytes the TLS layer holds undecrypted while the app is not reading
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
LARGE_BLOCK = 131072  # glibc's initial mmap threshold, kept

# Connections still waiting for their request headers, and connections receiving a request body,
# oldest first (one server per process).
_waiting: dict[GuardedHttpToolsProtocol, None] = {}
_receiving: dict[GuardedHttpToolsProtocol, None] = {}


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with a deadline for request headers and a cap on connections."""

    header_timeout_s: ClassVar[float] = 10.0
    body_timeout_s: ClassVar[float] = 20.0
    body_min_rate: ClassVar[float] = 4096.0
    send_timeout_s: ClassVar[float] = 30.0
    max_connections: ClassVar[int] = 4096
    _header_deadline: asyncio.TimerHandle | None = None
    _body_deadline: asyncio.TimerHandle | None = None
    _send_deadline: asyncio.TimerHandle | None = None
    _begun = False  # bytes of the awaited request have arrived (else: an idle kept-alive connection)
    _body_started = 0.0
    _body_bytes = 0
    _wide = False  # the connection's receive window is the kernel's largest

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # its receive window is the listening socket's, NARROW_WINDOW
        tls_limits = getattr(transport, "set_read_buffer_limits", None)  # a TLS transport's (uvloop's)
        if tls_limits is not None:
            tls_limits(high=TLS_READ_HIGH_WATER)
        self._await_headers()
        self._begun = True  # a connection that opens and sends nothing is a slow client too
        if len(self.connections) > self.max_connections:
            oldest = next((slow for slow in itertools.chain(_waiting, _receiving) if slow is not self), None)
            if oldest is None:
                self._close_slow("over_cap")
            else:  # an idle kept-alive connection closed to make room is no slow client
                oldest._close_slow("evicted" if oldest._begun else None)

    def data_received(self, data: bytes) -> None:
        self._begun = True
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._headers_arrived()
        super().on_headers_complete()
        if len(self.pipeline) > MAX_PIPELINED:
            self._close_slow("pipelined")
        elif not self.transport.is_closing():
            self._await_body()

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if not self._wide and self._body_bytes > WIDE_AFTER and not self.cycle.response_complete:
            self._wide = True
            self._set_window(WIDE_WINDOW)
        super().on_body(body)

    def _set_window(self, size: int) -> None:
        sock = self.transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)

    def on_message_complete(self) -> None:
        self._body_arrived()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)  # the next request's headers are in already
        super().on_response_complete()
        if not pipelined and not self.transport.is_closing():
            self._await_headers()  # a kept-alive connection's next request

    def pause_writing(self) -> None:
        """The send buffer is full: the client must read within `send_timeout_s`."""
        super().pause_writing()
        if self._send_deadline is None:
            self._send_deadline = self.loop.call_later(self.send_timeout_s, self._close_slow, "response")

    def resume_writing(self) -> None:
        self._reading_again()
        super().resume_writing()

    def _reading_again(self) -> None:
        if self._send_deadline is not None:
            self._send_deadline.cancel()
            self._send_deadline = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._headers_arrived()
        self._body_arrived()
        self._reading_again()
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        self._body_arrived()  # answered before its body was all in: the rest is read and dropped, under this deadline
        _waiting[self] = None
        self._begun = False
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _headers_arrived(self) -> None:
        _waiting.pop(self, None)
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_late(self) -> None:
        self._close_slow("headers" if self._begun else None)

    def _await_body(self) -> None:
        self._body_arrived()
        _receiving[self] = None
        self._body_started, self._body_bytes = self.loop.time(), 0
        self._body_deadline = self.loop.call_later(self.body_timeout_s, self._body_due)

    def _body_due(self) -> None:
        """Close the connection if its body is behind its deadline; else look again when it is due.
        While uvicorn is not reading (a pipelined request waiting its turn, an app not taking the
        body) the client is not to blame: the clock starts again."""
        if self.flow is not None and self.flow.read_paused:
            self._body_started, self._body_bytes = self.loop.time(), 0
            self._body_deadline = self.loop.call_later(self.body_timeout_s, self._body_due)
            return
        due = self._body_started + self.body_timeout_s + self._body_bytes / self.body_min_rate
        if self.loop.time() >= due:
            self._close_slow("body")
        else:
            self._body_deadline = self.loop.call_at(due, self._body_due)

    def _body_arrived(self) -> None:
        _receiving.pop(self, None)
        if self._body_deadline is not None:
            self._body_deadline.cancel()
            self._body_deadline = None

    def _close_slow(self, reason: str | None) -> None:
        """Close the connection (at once: what it has not read is dropped); `reason` None: an idle
        kept-alive one (not reported)."""
        self._headers_arrived()
        self._body_arrived()
        self._reading_again()
        if not self.transport.is_closing():
            self.transport.abort()
            if reason is not None:
                SlowClients.report(reason, self.client[0] if self.client else None)


def bind(config: uvicorn.Config) -> socket.socket:
    """The listening socket, its receive buffer NARROW_WINDOW before any connection arrives: an
    accepted connection inherits it, so the window it advertises is narrow from its first segment.
    Narrowing a connection once accepted instead shrinks a window its client was already given: the
    kernel drops what no longer fits and the client waits out retransmission timeouts (a 1 MB body
    on loopback took 6.7 s instead of milliseconds)."""
    sock = config.bind_socket()
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, NARROW_WINDOW)
    return sock


def raise_fd_limit() -> int:
    """Raise this process's open-file limit to its hard limit; return the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def give_back_large_blocks() -> bool:
    """Keep glibc's mmap threshold at its initial 128 KiB; whether it was set (not glibc: no).

    glibc raises the threshold to the size of each mapped block it frees (up to 32 MiB); past
    that, request bodies and TLS buffers come from the heap and stay with the process when freed
    (a flood of bodies kept ~60 MiB of 130). A fixed threshold keeps them mapped, given back when
    freed."""
    name = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None) if name else None
    return mallopt is not None and bool(mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK))


def main() -> None:
    # Until the app listens for it (serve.settings_reload), a `settings apply` must not end the
    # gateway: ignored, apply hears no answer and restarts it, saying so.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    home = Home.from_env()
    settings = load_settings(home.settings_file)
    gateway = settings.gateway
    descriptors = raise_fd_limit()
    give_back_large_blocks()
    GuardedHttpToolsProtocol.header_timeout_s = gateway.header_timeout_s
    GuardedHttpToolsProtocol.body_timeout_s = gateway.body_timeout_s
    GuardedHttpToolsProtocol.body_min_rate = gateway.body_min_rate
    GuardedHttpToolsProtocol.send_timeout_s = gateway.send_timeout_s
    GuardedHttpToolsProtocol.max_connections = max(16, min(gateway.max_connections, descriptors - FD_RESERVE))
    tls = GatewayTLS(settings, home) if gateway.https else None
    if tls is not None:
        quiet_undecodable_names()
    config = uvicorn.Config("serve.gateway:app_from_env", factory=True, host=gateway.bind, port=gateway.port,
                            http=GuardedHttpToolsProtocol, loop="serve.listener:guarded_loop", access_log=False,
                            log_level="warning",
                            timeout_graceful_shutdown=5, backlog=2048, **forwarding(gateway),
                            ssl_context_factory=(lambda *_: tls.context) if tls else None)
    server = _Server(config, tls)
    server.run(sockets=[bind(config)])
    if not server.started:
        sys.exit(3)  # as uvicorn.run: the app or the socket failed at start


class _GuardedLoop(uvloop.Loop):
    """uvloop's loop whose TLS listeners give a handshake the header deadline: a connection is
    handed to its protocol (and its deadlines and the connection cap) only once its handshake is
    done, so until then this is all that bounds it (asyncio's default is 60 s)."""

    async def create_server(self, *args: Any, **kwargs: Any) -> asyncio.AbstractServer:  # type: ignore[override]
        if kwargs.get("ssl") is not None:
            kwargs.setdefault("ssl_handshake_timeout", GuardedHttpToolsProtocol.header_timeout_s)
        return await super().create_server(*args, **kwargs)


def guarded_loop() -> asyncio.AbstractEventLoop:
    """uvicorn's loop factory (`loop="serve.listener:guarded_loop"`)."""
    return _GuardedLoop()


class _Server(uvicorn.Server):
    """uvicorn's server, with the gateway's certificates kept current while it serves HTTPS."""

    def __init__(self, config: uvicorn.Config, tls: GatewayTLS | None) -> None:
        super().__init__(config)
        self.tls = tls
        self.watching: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.tls is not None:
            self.watching = asyncio.create_task(self.tls.watch())


def forwarding(gateway: GatewaySettings) -> dict[str, Any]:
    """uvicorn's options for forwarded headers: believed only from the proxies the operator names
    (left alone, uvicorn believes any client on loopback)."""
    if not gateway.trusted_proxies:
        return {"proxy_headers": False}
    return {"proxy_headers": True, "forwarded_allow_ips": gateway.trusted_proxies}


if __name__ == "__main__":
    main()
