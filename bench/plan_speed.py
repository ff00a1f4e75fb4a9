"""Planner speed: time to plan Kimi-K2 (1T-parameter MoE, FP8) on 4 hosts x 8 GPUs and on 16
hosts x 8 GPUs, against planning Llama-3.1-405B on one 8-GPU host in the same run (the ratio).

Run: .venv/bin/python bench/plan_speed.py   Writes bench/results/plan_speed.json.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from appliance.records import Plan
from installer.hardware import parse_hardware_spec
from installer.model_config import load_model_config
from installer.planner import plan

ROOT = Path(__file__).parent.parent
CONFIGS = ROOT / "tests" / "data" / "model_configs"
RESULTS = Path(__file__).parent / "results" / "plan_speed.json"
REPEATS = 20


def seconds(model: str, hardware: str) -> tuple[float, Plan]:
    """Median wall time of a whole plan (config read included) over REPEATS runs."""
    times: list[float] = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        record = plan(load_model_config(CONFIGS / f"{model}.json"), parse_hardware_spec(hardware),
                      context=8192, concurrency=1)
        times.append(time.perf_counter() - started)
    return statistics.median(times), record


def main() -> None:
    baseline, _ = seconds("llama-3.1-405b", "1x8xH100-80GB")
    rows = []
    for hardware in ("4x8xH100-80GB", "16x8xH100-80GB"):
        took, record = seconds("kimi-k2", hardware)
        layout = record.layout
        rows.append({"model": "kimi-k2", "hardware": hardware, "seconds": round(took, 4),
                     "baseline_seconds": round(baseline, 4), "ratio": round(took / baseline, 2),
                     "layouts_rejected": len(record.rejected),
                     "chosen": f"TP{layout.tp} x PP{layout.pp} x DP{layout.dp}{' + EP' if layout.ep else ''}"
                               if layout else None})
        print(json.dumps(rows[-1]), flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"bench": "plan_speed", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                   "host_cpus": len(os.sched_getaffinity(0)),
                                   "baseline": "llama-3.1-405b on 1x8xH100-80GB", "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
