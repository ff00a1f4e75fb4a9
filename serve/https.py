"""The gateway's HTTPS: the certificates it shows, swapped in while it serves.

It shows the network the organisation's certificate (`gateway.certificate`) or, without one, the
certificate the appliance's CA issues it; the appliance's own processes ask for `localhost` (SNI)
and get the CA's, which names it. Every RELOAD_S the gateway renews the CA's certificate near its
end (appliance.tls) and, for any pair whose files changed (`appliance tls renew`, or the
organisation's replaced), checks it as `appliance up` does and builds a context of its own from a
private copy: each handshake starts from one fixed context whose SNI callback moves it to the
current context, so new handshakes use the new pair whole (never the old certificate beside the
new one) and open connections go on. A pair caught half-replaced, or a wrong one, leaves the one
in use serving, and is logged once. The file work runs off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.errors import StateError
from appliance.home import Home
from appliance.settings import Settings
from appliance.tls import LOOPBACK_NAME, gateway_certificate, organisation_certificate_problem, server_context

log = logging.getLogger("appliance.gateway")
RELOAD_S = 2.0


@dataclass
class _Served:
    """A certificate pair's files and the context built from them."""

    certificate: Path
    private_key: Path
    context: ssl.SSLContext = field(init=False)
    stamp: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.stamp = self._stamp()
        self.context = self._build()

    def _stamp(self) -> tuple[int, ...]:
        stats = [path.stat() for path in (self.certificate, self.private_key)]
        return tuple(value for stat in stats for value in (stat.st_ino, stat.st_mtime_ns, stat.st_size))

    def _build(self) -> ssl.SSLContext:
        """A context from a private copy of the pair, checked first as `appliance up` checks it
        (StateError naming the files)."""
        problem = organisation_certificate_problem(self.certificate, self.private_key)
        if problem:
            raise StateError(problem)
        with tempfile.TemporaryDirectory() as aside:  # what is checked is what is loaded
            certificate, private_key = Path(aside, "certificate.pem"), Path(aside, "key.pem")
            certificate.write_bytes(self.certificate.read_bytes())
            fd = os.open(private_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as key:
                key.write(self.private_key.read_bytes())
            try:
                return server_context(certificate, private_key)
            except StateError:
                raise StateError(f"{self.private_key} is not the key of {self.certificate}, or either is not "
                                 "PEM (changed while it was read?)") from None

    def reload(self) -> bool:
        """A new context if the pair's files changed; whether there is one."""
        stamp = self._stamp()
        if stamp == self.stamp:
            return False
        self.context = self._build()
        self.stamp = stamp
        return True


class GatewayTLS:
    """The contexts the gateway serves HTTPS from, and their renewal and reloading."""

    def __init__(self, settings: Settings, home: Home) -> None:
        self.settings, self.home = settings, home
        self.local = _Served(*gateway_certificate(settings, home))
        gateway = settings.gateway
        self.network = self.local
        if gateway.certificate and gateway.private_key:
            self.network = _Served(Path(gateway.certificate), Path(gateway.private_key))
        # Where every handshake starts (uvicorn's context): TLS versions and ciphers are its own,
        # the certificate the current one its SNI callback chooses.
        self.context = server_context(self.network.certificate, self.network.private_key)
        self.context.sni_callback = self._choose
        self._last_problem = ""

    def _choose(self, connection: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, _: ssl.SSLContext) -> None:
        connection.context = (self.local if server_name == LOOPBACK_NAME else self.network).context

    def refresh(self) -> None:
        """Renew the CA's certificate if it is near its end, and rebuild each pair that changed. A
        failure is logged once and the pairs in use go on serving."""
        try:
            gateway_certificate(self.settings, self.home)
            for served in {id(pair): pair for pair in (self.local, self.network)}.values():
                if served.reload():
                    log.warning("gateway: now serving the certificate in %s", served.certificate)
            self._last_problem = ""
        except Exception as exc:  # whatever it was, the pairs in use go on serving
            if str(exc) != self._last_problem:
                log.error("gateway: the certificate in use goes on serving: %s", exc)
            self._last_problem = str(exc)

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(RELOAD_S)
            # Renewal takes a lock, makes a key and syncs files: off the loop. It replaces a
            # context whole (an attribute the SNI callback reads), never changes one in use.
            await asyncio.to_thread(self.refresh)


class _QuietUndecodableNames:
    """An SNI name that is not ASCII fails to decode before the callback runs, and Python reports
    it as an unraisable exception, a traceback per connection: at most one line a minute here."""

    def __init__(self) -> None:
        self.previous = sys.unraisablehook
        self.said_at = float("-inf")

    def __call__(self, unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, UnicodeError):
            if time.monotonic() - self.said_at >= 60:
                log.warning("gateway: a TLS client sent a server name that is not ASCII (refused)")
                self.said_at = time.monotonic()
            return
        self.previous(unraisable)


def quiet_undecodable_names() -> None:
    sys.unraisablehook = _QuietUndecodableNames()
