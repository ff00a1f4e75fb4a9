"""HTTP over a Unix socket (an engine's, a program's health check): httpx's transport without the
CA bundle it would load for every new transport. A Unix socket carries no TLS, and loading the
bundle took 40 ms of every look the watchdog had at an engine (most of its time)."""

from __future__ import annotations

import functools
import ssl
from pathlib import Path

import httpx


@functools.cache
def _unused_tls() -> ssl.SSLContext:
    return ssl.create_default_context()  # never used to verify anything: no TLS on a Unix socket


def unix_transport(socket: Path) -> httpx.HTTPTransport:
    """A transport to the HTTP server listening on `socket`."""
    return httpx.HTTPTransport(uds=str(socket), verify=_unused_tls())
