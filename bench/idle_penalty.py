"""What this machine charges for work done right after idling: small operations of the kind a
gateway does per request, timed back to back and after 0.3 s of sleep (as a gateway waits for an
engine), in the same process. The ratio is the penalty an engine-paced request pays for every
distinct thing it touches; bench/gateway_overhead.py's stub_idle section shows its sum.

Run: .venv/bin/python bench/idle_penalty.py. Writes bench/results/idle_penalty.json.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "idle_penalty.json"
IDLE_S = 0.3
BACK_TO_BACK_RUNS = 300
AFTER_IDLE_RUNS = 30
RECORD = {"action": "chat.completions", "status": 200, "subject": "s" * 36, "prompt_hmac": "a" * 64,
          "resource": "SmolLM2-135M-Instruct", "prompt_tokens": 10, "completion_tokens": 2}


def median_us(operation: Callable[[], object], runs: int, idle_s: float) -> float:
    times = []
    for _ in range(runs):
        if idle_s:
            time.sleep(idle_s)
        started = time.perf_counter()
        operation()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def flock_and_unlock(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_EX)
    fcntl.flock(fd, fcntl.LOCK_UN)


def main() -> None:
    # Under the state directory's filesystem when there is one: the audit log's disk.
    base = Path(os.environ.get("APPLIANCE_HOME", tempfile.gettempdir()))
    with tempfile.TemporaryDirectory(dir=base if base.is_dir() else None) as scratch:
        directory = Path(scratch)
        lock = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        log = os.open(directory / "log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        line = json.dumps(RECORD).encode() + b"\n"

        def write_and_flush() -> None:
            os.write(log, line)
            os.fdatasync(log)

        operations: dict[str, Callable[[], object]] = {
            "nothing": lambda: None,
            "flock and unlock": lambda: flock_and_unlock(lock),
            "fstat": lambda: os.fstat(log),
            "stat of a missing path": lambda: (directory / "missing").exists(),
            "canonical JSON and SHA-256 of a record": lambda: hashlib.sha256(
                json.dumps(RECORD, sort_keys=True, separators=(",", ":")).encode()).hexdigest(),
            "append a record and fdatasync": write_and_flush,
        }
        small = [operation for name, operation in operations.items() if name != "append a record and fdatasync"]
        # Whether the penalty is paid once per wake-up or for each thing touched after it.
        operations["the five small ones in a row"] = lambda: [operation() for operation in small]
        rows = []
        for name, operation in operations.items():
            warm = median_us(operation, BACK_TO_BACK_RUNS, 0.0)
            idle = median_us(operation, AFTER_IDLE_RUNS, IDLE_S)
            rows.append({"operation": name, "back_to_back_us": round(warm, 1),
                         "after_idle_us": round(idle, 1), "ratio": round(idle / warm, 1)})
            print(json.dumps(rows[-1]), flush=True)
        os.close(lock)
        os.close(log)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"bench": "idle_penalty", "idle_s": IDLE_S,
                                   "host_cpus": len(os.sched_getaffinity(0)), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
