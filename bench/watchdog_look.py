"""One look of the watchdog at an engine (serve.watchdog.observe: /health, then /metrics over the
engine's Unix socket, the watched counters summed) against the look as it was before: a new httpx
transport that loads the CA bundle each time, and every family of the exposition parsed. The
engine is a small server on a Unix socket answering /health and a /metrics exposition shaped like
vLLM 0.32's on the CPU engine (90 families: counters, gauges and histograms with the engine's
labels, about 600 lines). The two looks take turns over N rounds; medians and their ratio.

Run: .venv/bin/python -m bench.watchdog_look [--rounds 200]
Writes bench/results/watchdog_look.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket as sockets
import socketserver
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from appliance.programs import Program
from serve.engine import ENGINE_BASE_URL
from serve.watchdog import BUSY, KV_USE, PROGRESS, observe

RESULTS = Path(__file__).parent / "results" / "watchdog_look.json"
LABELS = ["engine", "model_name"]


def exposition() -> bytes:
    """vLLM's shape: the watched families among 90, each with the engine's labels."""
    registry = CollectorRegistry()
    for name in (*BUSY, KV_USE):
        Gauge(name, name, LABELS, registry=registry).labels("0", "demo").set(1)
    for name in PROGRESS:
        Counter(name, name, LABELS, registry=registry).labels("0", "demo").inc(100)
    for i in range(30):
        Counter(f"vllm:other_total_{i}", "other", LABELS, registry=registry).labels("0", "demo").inc(i)
        Gauge(f"vllm:other_gauge_{i}", "other", LABELS, registry=registry).labels("0", "demo").set(i)
    for i in range(25):
        Histogram(f"vllm:other_seconds_{i}", "other", LABELS, registry=registry).labels("0", "demo").observe(0.5)
    return generate_latest(registry)


class Engine(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:
        payload = self.body if self.path == "/metrics" else b""
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError):  # a look that needs no body closes before it
            self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


class UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def get_request(self) -> tuple[sockets.socket, Any]:  # BaseHTTPRequestHandler wants an address
        connection, _ = self.socket.accept()
        return connection, ("engine", 0)


def before(program: Program, key: str) -> None:
    """The look as it was: a transport that loads the CA bundle, every family parsed."""
    assert program.socket is not None
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(program.socket)), base_url=ENGINE_BASE_URL,
                      timeout=5) as engine:
        engine.get("/health")
        text = engine.get("/metrics", headers={"Authorization": f"Bearer {key}"}).text
    sum(1 for _ in text_string_to_metric_families(text))


def now(program: Program, key: str) -> None:
    observe(program, key)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=200)
    rounds = parser.parse_args().rounds
    Engine.body = exposition()
    with tempfile.TemporaryDirectory() as directory:
        socket = Path(directory) / "engine.sock"
        server = UnixServer(str(socket), Engine)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        program = Program(name="vllm-main", command=["engine"], socket=socket)
        looks: dict[str, tuple[Callable[[Program, str], None], list[float], list[float]]] = {
            "before": (before, [], []), "now": (now, [], [])}
        for _ in range(rounds):
            for look, wall, cpu in looks.values():
                started, began = time.perf_counter(), time.process_time()
                look(program, "key")
                wall.append(time.perf_counter() - started)
                cpu.append(time.process_time() - began)
        server.shutdown()
    result = {"bench": "watchdog_look", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "rounds": rounds, "exposition_lines": Engine.body.count(b"\n"),
              **{f"{name}_ms": round(statistics.median(wall) * 1000, 2) for name, (_, wall, _) in looks.items()},
              **{f"{name}_cpu_ms": round(statistics.median(cpu) * 1000, 2) for name, (_, _, cpu) in looks.items()}}
    result["now_vs_before_cpu"] = round(result["now_cpu_ms"] / result["before_cpu_ms"], 3)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
