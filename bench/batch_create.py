"""Batch creation and the gateway's responsiveness: creating batches from a 32 MiB input file
whose last line is bad, while a client times anonymous `/healthz` on the same process.

The server is the gateway's own batch router (serve.routes.batches) and a `/healthz` answered on
the event loop as the gateway's is, under uvicorn in a process of its own (authentication and
rate limits stubbed: they are not what is measured). Two rounds, four creations each, at once:

- before: the previous create route, which read and checked the whole file inside the gateway
  process (appliance/batches.py as of the commit named in the results, loaded from git);
- after: the create route of this tree, which answers `validating` at once; the batch-worker's
  validation runs meanwhile in a process of its own (as the supervised worker does), and /healthz
  is timed until every batch has failed validation.

Prints the figures and writes bench/results/batch_create.json.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx

from appliance import batches
from appliance.artifacts import artifact_store
from appliance.batches import BatchAsk, Owner
from appliance.home import Home
from appliance.settings import Settings
from bench.earlier import module_at

RESULTS = Path(__file__).parent / "results" / "batch_create.json"
PROJECT = Path(__file__).resolve().parent.parent
SELF = [sys.executable, "-m", "bench.batch_create"]  # as its server and its worker
BEFORE_COMMIT = "606ba0a"  # the last commit validating input files inside the gateway
PORT = 18620
FILE_BYTES = 32 << 20
CREATIONS = 4
LINE_PAD = 620  # bytes of prompt a line: 32 MiB in ~48,000 requests, under batch.max_requests
OWNER = Owner("bench-subject", "bench", frozenset({"user"}))


def old_batches() -> ModuleType:
    """appliance/batches.py as of BEFORE_COMMIT, importable under another name."""
    return module_at(BEFORE_COMMIT, "appliance/batches.py", "old_batches")


def serve(home_dir: str) -> None:
    """The server process: the batch router, the previous create route under /before, /healthz."""
    import anyio
    import uvicorn
    from fastapi import FastAPI

    from serve.auth import Principal
    from serve.routes import batches as routes

    home = Home(Path(home_dir))
    settings = Settings()
    app = FastAPI()
    who = Principal(subject=OWNER.subject, username=OWNER.username, client="bench", roles=OWNER.roles,
                    token_id="bench", expires_at=time.time() + 86400)
    app.dependency_overrides[routes.admitted] = lambda: who
    app.include_router(routes.router(settings, home))
    old = old_batches()
    store = artifact_store(settings.artifacts, home)
    parsing = anyio.CapacityLimiter(2)  # the previous route's limiter

    @app.post("/before/v1/batches")
    async def create_before(ask: BatchAsk) -> dict[str, Any]:
        batch = await anyio.to_thread.run_sync(lambda: old.create(
            home, store, ask, OWNER, settings.batch, settings.gateway.max_body_bytes), limiter=parsing)
        return {"id": batch.id, "status": batch.status}

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    uvicorn.run(app, host="127.0.0.1", port=PORT, log_level="warning")


def validate_all(home_dir: str) -> None:
    """The worker process: validates every batch waiting, as the batch-worker does; prints each."""
    home = Home(Path(home_dir))
    settings = Settings()
    store = artifact_store(settings.artifacts, home)
    while (job := batches.claim_validation(home, os.getpid(), lambda pid: pid == os.getpid())) is not None:
        started = time.perf_counter()
        batch = batches.validate(home, store, job, settings.batch, settings.gateway.max_body_bytes, None)
        print(json.dumps({"batch": batch.id, "status": batch.status, "seconds": time.perf_counter() - started}),
              flush=True)


def input_file() -> bytes:
    lines = []
    size, index = 0, 0
    while size < FILE_BYTES:
        line = json.dumps({"custom_id": f"q-{index}", "method": "POST", "url": "/v1/chat/completions",
                           "body": {"model": "assistant", "max_tokens": 16,
                                    "messages": [{"role": "user", "content": f"{index} " + "x" * LINE_PAD}]}})
        lines.append(line)
        size += len(line) + 1
        index += 1
    lines[-1] = lines[-1][:-1]  # the last line bad: the whole file must be read to find it
    return ("\n".join(lines) + "\n").encode()


class Pinger:
    """/healthz timed back to back from a thread of its own, until stopped."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run)

    def run(self) -> None:
        with httpx.Client(base_url=f"http://127.0.0.1:{PORT}") as client:
            while not self.stop.is_set():
                started = time.perf_counter()
                client.get("/healthz").raise_for_status()
                self.samples.append((time.perf_counter() - started) * 1000)
                time.sleep(0.01)

    def __enter__(self) -> Pinger:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def figures(self) -> dict[str, float]:
        ordered = sorted(self.samples)
        return {"samples": len(ordered), "p50_ms": round(statistics.median(ordered), 2),
                "p99_ms": round(ordered[int(len(ordered) * 0.99) - 1], 2), "max_ms": round(ordered[-1], 2)}


def creations(path: str, file_id: str) -> list[float]:
    """CREATIONS creations at once; each one's latency in seconds."""
    latencies: list[float] = []

    def one() -> None:
        started = time.perf_counter()
        answer = httpx.post(f"http://127.0.0.1:{PORT}{path}", timeout=600, json={
            "input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"})
        answer.raise_for_status()
        latencies.append(time.perf_counter() - started)

    threads = [threading.Thread(target=one) for _ in range(CREATIONS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies


def timed(call: Callable[[], None]) -> dict[str, Any]:
    with Pinger() as pinger:
        started = time.perf_counter()
        call()
        wall = time.perf_counter() - started
    return {"wall_s": round(wall, 2), "healthz": pinger.figures()}


def main() -> None:
    home = Home(Path(tempfile.mkdtemp(prefix="batch-create-")) / "home").ensure()
    settings = Settings()
    data = input_file()
    file_id = batches.add_file(home, artifact_store(settings.artifacts, home), owner=OWNER.subject,
                               filename="big.jsonl", purpose="batch", data=data, limits=settings.batch).id
    lines = data.count(b"\n")
    server = subprocess.Popen([*SELF, "serve", str(home.root)], cwd=PROJECT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{PORT}/healthz").raise_for_status()
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.2)
        idle = timed(lambda: time.sleep(3))
        before_latencies: list[float] = []
        before = timed(lambda: before_latencies.extend(creations("/before/v1/batches", file_id)))
        time.sleep(3)  # the server frees the previous round's parsed files
        httpx.get(f"http://127.0.0.1:{PORT}/v1/batches").raise_for_status()  # this tree's queue opened once
        after_latencies: list[float] = []
        worker_runs: list[dict[str, Any]] = []

        def after_round() -> None:
            after_latencies.extend(creations("/v1/batches", file_id))
            worker = subprocess.run([*SELF, "validate", str(home.root)], capture_output=True, text=True,
                                    check=True, cwd=PROJECT)
            worker_runs.extend(json.loads(row) for row in worker.stdout.splitlines())

        after = timed(after_round)
    finally:
        server.terminate()
        server.wait()
    statuses = {batch.status for batch in batches.listing(home, OWNER.subject, limit=100)}
    per_file_s = statistics.median(run["seconds"] for run in worker_runs)
    results = {
        "file": {"bytes": len(data), "lines": lines, "bad_line": lines},
        "creations_at_once": CREATIONS,
        "cpus": os.cpu_count(),
        "healthz_idle": idle["healthz"],
        "before": {"commit": BEFORE_COMMIT, "create_s": sorted(round(s, 2) for s in before_latencies), **before},
        "after": {"create_ms": sorted(round(s * 1000, 1) for s in after_latencies), **after,
                  "note": "wall_s and healthz cover the creations and the worker validating all four files"},
        "worker_validation": {"files": len(worker_runs), "median_s_per_file": round(per_file_s, 2),
                              "lines_per_s": round(lines / per_file_s),
                              "mb_per_s": round(len(data) / per_file_s / 1e6, 1),
                              "statuses": sorted({run["status"] for run in worker_runs})},
        "statuses_after": sorted(statuses),
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "serve":
        serve(sys.argv[2])
    elif len(sys.argv) == 3 and sys.argv[1] == "validate":
        validate_all(sys.argv[2])
    else:
        main()
