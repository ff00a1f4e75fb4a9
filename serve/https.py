"""The gateway's HTTPS: the certificates it shows, swapped in while it serves.

It shows the network the organisation's certificate (`gateway.certificate`) or, without one, the
certificate the appliance's CA issues it; the appliance's own processes ask for `localhost` (SNI)
and get the CA's, which names it. Every RELOAD_S the gateway renews the CA's certificate near its
end (appliance.tls) and loads any pair whose files changed (`appliance tls renew`, or the
organisation's replaced) into the contexts it serves from: new handshakes use it, connections open
go on. A pair is copied aside and tried in a context of its own before it is loaded, so a pair
caught half-replaced, or a wrong one, leaves the one in use serving (and is logged).
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from appliance.errors import ApplianceError
from appliance.home import Home
from appliance.settings import Settings
from appliance.tls import LOOPBACK_NAME, gateway_certificate, load_pair, server_context

log = logging.getLogger("appliance.gateway")
RELOAD_S = 2.0


@dataclass
class _Served:
    """A certificate pair's files and the context serving it."""

    certificate: Path
    private_key: Path
    context: ssl.SSLContext = field(init=False)
    stamp: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.stamp = self._stamp()
        self.context = server_context(self.certificate, self.private_key)

    def _stamp(self) -> tuple[int, ...]:
        stats = [path.stat() for path in (self.certificate, self.private_key)]
        return tuple(value for stat in stats for value in (stat.st_ino, stat.st_mtime_ns, stat.st_size))

    def reload(self) -> bool:
        """Load the pair into the context if its files changed; whether it did."""
        stamp = self._stamp()
        if stamp == self.stamp:
            return False
        with tempfile.TemporaryDirectory() as aside:  # what is tried is what is loaded
            certificate, private_key = Path(aside, "certificate.pem"), Path(aside, "key.pem")
            certificate.write_bytes(self.certificate.read_bytes())
            fd = os.open(private_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as key:
                key.write(self.private_key.read_bytes())
            server_context(certificate, private_key)
            load_pair(self.context, certificate, private_key)
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
            self.network.context.sni_callback = self._choose
        self._last_problem = ""

    @property
    def context(self) -> ssl.SSLContext:
        """What a handshake starts from (one asking for `localhost` moves to the CA's certificate)."""
        return self.network.context

    def _choose(self, connection: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, _: ssl.SSLContext) -> None:
        if server_name == LOOPBACK_NAME:
            connection.context = self.local.context

    def refresh(self) -> None:
        """Renew the CA's certificate if it is near its end, and load each pair that changed. A
        failure is logged once and the pairs in use go on serving."""
        try:
            gateway_certificate(self.settings, self.home)
            for served in {id(pair): pair for pair in (self.local, self.network)}.values():
                if served.reload():
                    log.warning("gateway: now serving the certificate in %s", served.certificate)
            self._last_problem = ""
        except (ApplianceError, OSError, ssl.SSLError, ValueError) as exc:
            if str(exc) != self._last_problem:
                log.error("gateway: the certificate in use goes on serving: %s", exc)
            self._last_problem = str(exc)

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(RELOAD_S)
            self.refresh()  # in the loop's thread: no handshake reads a context while it changes
