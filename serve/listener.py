"""The gateway's listener: uvicorn (httptools) guarded against connection floods.

uvicorn itself never times out a connection that opens and sends its request headers slowly or
not at all, and accepts connections until the process runs out of file descriptors; then no
one gets in. Here:
- a connection must complete its request headers within `gateway.header_timeout_s` of opening
  (or of its previous response ending) or it is closed;
- past `gateway.max_connections` open connections, the oldest one still waiting for its headers
  is closed to make room (an honest client sends its headers at once);
- the process raises its file-descriptor limit to the hard limit (supervisord's `minfds` raises
  that of every program it runs), so the cap, not the limit, decides.

supervisord runs `python -m serve.listener`.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import ClassVar

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from appliance.home import Home
from appliance.settings import load_settings

log = logging.getLogger("appliance.gateway")
FD_RESERVE = 128  # descriptors kept for the log, engines, Keycloak and the audit writer

# Connections still waiting for their request headers, oldest first (one server per process).
_waiting: dict[GuardedHttpToolsProtocol, None] = {}


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with a deadline for request headers and a cap on connections."""

    header_timeout_s: ClassVar[float] = 10.0
    max_connections: ClassVar[int] = 4096
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_headers()
        if len(self.connections) > self.max_connections:
            oldest = next((waiting for waiting in _waiting if waiting is not self), None)
            if oldest is not None:
                oldest._close_slow()

    def on_headers_complete(self) -> None:
        self._headers_arrived()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)  # the next request's headers are in already
        super().on_response_complete()
        if not pipelined and not self.transport.is_closing():
            self._await_headers()  # a kept-alive connection's next request

    def connection_lost(self, exc: Exception | None) -> None:
        self._headers_arrived()
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        _waiting[self] = None
        self._deadline = self.loop.call_later(self.header_timeout_s, self._close_slow)

    def _headers_arrived(self) -> None:
        _waiting.pop(self, None)
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _close_slow(self) -> None:
        self._headers_arrived()
        if not self.transport.is_closing():
            self.transport.close()


def raise_fd_limit() -> int:
    """Raise this process's open-file limit to its hard limit; return the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def main() -> None:
    home = Home.from_env()
    settings = load_settings(home.settings_file)
    gateway = settings.gateway
    descriptors = raise_fd_limit()
    GuardedHttpToolsProtocol.header_timeout_s = gateway.header_timeout_s
    GuardedHttpToolsProtocol.max_connections = max(16, min(gateway.max_connections, descriptors - FD_RESERVE))
    uvicorn.run("serve.gateway:app_from_env", factory=True, host=gateway.bind, port=gateway.port,
                http=GuardedHttpToolsProtocol, loop="uvloop", access_log=False, log_level="warning",
                timeout_graceful_shutdown=5, backlog=2048)


if __name__ == "__main__":
    main()
