"""A webhook receiver on loopback standing in for the organisation's alert relay: what Alertmanager
posts to the session's `monitoring.webhook_url`, as it arrives."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any
from urllib.parse import urlsplit


@contextmanager
def webhook_receiver(url: str) -> Iterator[list[dict[str, Any]]]:
    """Listen on `url`'s loopback port; yields the posts received so far (a list that grows)."""
    received: list[dict[str, Any]] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", urlsplit(url).port or 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield received
    finally:
        server.shutdown()
        server.server_close()


def firing(posts: list[dict[str, Any]], alertname: str, **labels: str) -> list[dict[str, Any]]:
    """The firing alerts named `alertname` (with `labels`) among the posts."""
    return [alert for post in list(posts) for alert in post["alerts"]
            if alert["status"] == "firing" and alert["labels"].get("alertname") == alertname
            and all(alert["labels"].get(key) == value for key, value in labels.items())]
