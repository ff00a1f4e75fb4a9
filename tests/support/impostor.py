"""A listener that takes someone else's port, as a local attacker would, and keeps every byte a
client sends it: plain TCP, or TLS with a certificate of its own."""

from __future__ import annotations

import socket
import ssl
import threading
from pathlib import Path


class Impostor:
    def __init__(self, port: int = 0, certificate: tuple[Path, Path] | None = None) -> None:
        self.received: list[bytes] = []  # per connection: what arrived (decrypted, if TLS got that far)
        self._tls = None
        if certificate:
            self._tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self._tls.load_cert_chain(*certificate)
        self._listener = socket.create_server(("127.0.0.1", port))
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._take, args=(conn,), daemon=True).start()

    def _take(self, conn: socket.socket) -> None:
        got = bytearray()
        self.received.append(b"")
        index = len(self.received) - 1
        conn.settimeout(1)  # a client waiting for a ServerHello gets an EOF
        try:
            if self._tls:
                conn = self._tls.wrap_socket(conn, server_side=True)
            while chunk := conn.recv(65536):
                got += chunk
                self.received[index] = bytes(got)
                if b"\r\n\r\n" in got:  # a whole request head: answer like a server would
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                 b"content-length: 15\r\n\r\n{\"active\":true}")
        except (OSError, ssl.SSLError):
            pass
        finally:
            conn.close()

    def everything(self) -> bytes:
        return b"".join(self.received)

    def close(self) -> None:
        # shutdown() wakes the thread blocked in accept(); close() alone would leave the port bound.
        self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(5)

    def __enter__(self) -> Impostor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
