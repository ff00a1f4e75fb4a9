"""The least a Python HTTP proxy does: uvicorn in, aiohttp out, nothing else (no auth, no limits,
no audit record, no metrics). The gateway overhead bench runs it beside the gateway so the
figures show what this machine charges for one Python hop at all; the gateway's own work is the
difference.

With BARE_PROXY_DURABLE_FILE set it also keeps the audit log's rule (a request's record
is on disk before its response is complete) in its barest form: one line appended to that file
and fdatasync'd before the response's end is sent.

Run: BARE_PROXY_TARGET=http://127.0.0.1:PORT uvicorn bench.bare_proxy:app --port N
"""

from __future__ import annotations

import os
from typing import Any

import aiohttp

# http://HOST:PORT, or unix:SOCKET for an engine on a Unix socket (as the appliance runs them).
TARGET = os.environ.get("BARE_PROXY_TARGET", "http://127.0.0.1:8000")
DURABLE_FILE = os.environ.get("BARE_PROXY_DURABLE_FILE")


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        await _lifespan(receive, send)
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    headers = {"content-type": "application/json"}
    for name, value in scope["headers"]:
        if name == b"authorization":  # the engine's API key, when the target is vLLM
            headers["authorization"] = value.decode()
    base = "http://engine" if TARGET.startswith("unix:") else TARGET
    async with _session.request(scope["method"], base + scope["path"], data=body, headers=headers) as response:
        await send({"type": "http.response.start", "status": response.status,
                    "headers": [(b"content-type", response.headers.get("content-type", "").encode())]})
        async for chunk in response.content.iter_any():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    if _durable is not None:
        os.write(_durable, b"%d %s\n" % (response.status, scope["path"].encode()))
        os.fdatasync(_durable)
    await send({"type": "http.response.body", "body": b""})


_session: aiohttp.ClientSession
_durable: int | None = None


async def _lifespan(receive: Any, send: Any) -> None:
    global _session, _durable
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            connector = aiohttp.UnixConnector(path=TARGET[len("unix:"):]) if TARGET.startswith("unix:") else None
            _session = aiohttp.ClientSession(connector=connector)
            if DURABLE_FILE:
                _durable = os.open(DURABLE_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await _session.close()
            await send({"type": "lifespan.shutdown.complete"})
            return
