"""Where the listener (serve.listener, run as a program: its own module is `__main__`) reports the
connections it closes for slowness, and where the gateway app in the same process hears of them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import ClassVar

log = logging.getLogger("appliance.gateway")


class SlowClients:
    """Where the listener reports a connection it closed for slowness: `closed(reason, peer)` with
    reason "headers", "body" or "evicted". The gateway sets it (one server per process)."""

    closed: ClassVar[Callable[[str, str | None], None] | None] = None

    @classmethod
    def report(cls, reason: str, peer: str | None) -> None:
        if cls.closed is not None:
            try:
                cls.closed(reason, peer)
            except Exception:  # accounting never keeps a slow connection open
                log.exception("slow connection not accounted")
