"""Audit log throughput: durable records/s with 1, 8 and 64 concurrent writers (group commit),
against appending the same bytes with one fdatasync per record (the writer's sync), in the same
run on the same disk; and verification speed in MB/s. The disk here is noisy, so the two take turns three times and the
medians are compared.

Run: .venv/bin/python bench/audit_throughput.py   Writes bench/results/audit_throughput.json.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from audit import AuditEvent, AuditWriter, verify
from audit.writer import log_files

RESULTS = Path(__file__).parent / "results" / "audit_throughput.json"
RECORDS = {1: 1000, 8: 4000, 64: 8000}
ROUNDS = 3
SIGNER = Ed25519PrivateKey.generate()


def event(n: int) -> AuditEvent:
    return AuditEvent(request_id=f"{n:032x}", action="chat.completions", outcome="allowed", status=200,
                      subject="6f1c0b6e-0000-4000-8000-000000000000", username="alice", client="appliance-cli",
                      source="127.0.0.1", resource="SmolLM2-135M-Instruct", prompt_tokens=37,
                      completion_tokens=8, latency_ms=512.3, prompt_hmac="a" * 64, completion_hmac="b" * 64)


def run_threads(writers: int, total: int, work: Callable[[int], object]) -> float:
    """Seconds for `writers` threads to do `total` calls of work(n) between them."""
    per = total // writers
    threads = [threading.Thread(target=lambda i=i: [work(i * per + j) for j in range(per)]) for i in range(writers)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


def group_commit(directory: Path, writers: int, total: int) -> float:
    writer = AuditWriter(directory, SIGNER, checkpoint_every=1000)
    return total / run_threads(writers, total, lambda n: writer.append(event(n)))


def fsync_each(directory: Path, writers: int, total: int, line: bytes) -> float:
    """The baseline: the same bytes, each record written and fdatasynced on its own under a lock."""
    lock = threading.Lock()
    handle = open(directory / "baseline.jsonl", "ab")

    def append(_: int) -> None:
        with lock:
            handle.write(line)
            handle.flush()
            os.fdatasync(handle.fileno())

    try:
        return total / run_threads(writers, total, append)
    finally:
        handle.close()


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="audit-bench-", dir=Path(__file__).parent.parent))
    rows = []
    try:
        line = event(0).model_dump_json().encode() + b"\n"
        for writers, total in RECORDS.items():
            base = root / f"base-{writers}"
            base.mkdir()
            baselines, groups = [], []
            for _ in range(ROUNDS):  # one log, appended to in turns: the chain goes on across rounds
                baselines.append(fsync_each(base, writers, total, line))
                groups.append(group_commit(root / f"log-{writers}", writers, total))
            baseline, grouped = statistics.median(baselines), statistics.median(groups)
            rows.append({"writers": writers, "records": total, "group_commit_records_per_s": round(grouped),
                         "fsync_each_records_per_s": round(baseline), "ratio": round(grouped / baseline, 2)})
            print(json.dumps(rows[-1]), flush=True)
        directory = root / "log-64"
        size = sum(p.stat().st_size for p in log_files(directory))
        started = time.perf_counter()
        verified = verify(directory, SIGNER.public_key())
        mb_per_s = size / (time.perf_counter() - started) / 1e6
        print(json.dumps({"verify_mb_per_s": round(mb_per_s, 1), "verified_records": verified.records}))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {"bench": "audit_throughput", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "host_cpus": len(os.sched_getaffinity(0)), "disk": "the checkout's filesystem",
              "rows": rows, "verify_mb_per_s": round(mb_per_s, 1), "verified_bytes": size}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
