"""Planner speed: time to plan Kimi-K2 (1T-parameter MoE, FP8) on 4 hosts x 8 GPUs and on 16
hosts x 8 GPUs, against planning Llama-3.1-405B on one 8-GPU host in the same run (the ratio).
And what the capacity objective gains: the KV-cache tokens of the layout it chooses against the
fewest-GPUs layout (`--objective min-gpus`, the rule before) on the shipped cases (the ratio).

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
# (model, hardware, context, concurrency): the models and GPU shapes bench/plan_compare.py compares.
CASES = [("llama-3.1-405b", "2x8xH100-80GB", 32768, 16), ("llama-3.1-70b", "1x8xH100-80GB", 32768, 16),
         ("qwen3-235b-a22b", "1x8xH100-80GB", 32768, 16), ("mixtral-8x22b", "1x8xH100-80GB", 32768, 16),
         ("deepseek-v3", "1x8xH200-141GB", 32768, 16), ("kimi-k2", "2x8xH200-141GB", 131072, 1)]


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
    gains = [capacity_gain(*case) for case in CASES]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"bench": "plan_speed", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                   "host_cpus": len(os.sched_getaffinity(0)),
                                   "baseline": "llama-3.1-405b on 1x8xH100-80GB", "rows": rows,
                                   "capacity_gain": gains}, indent=2) + "\n")


def capacity_gain(model: str, hardware: str, context: int, concurrency: int) -> dict[str, object]:
    """Both objectives' layouts for one case, their KV tokens, and the ratio."""
    shape, profile = load_model_config(CONFIGS / f"{model}.json"), parse_hardware_spec(hardware)
    chosen = {objective: plan(shape, profile, context=context, concurrency=concurrency, objective=objective)
              for objective in ("capacity", "min-gpus")}
    row: dict[str, object] = {"model": model, "hardware": hardware, "context": context, "concurrency": concurrency}
    for objective, record in chosen.items():
        layout = record.layout
        row[objective] = {"layout": f"TP{layout.tp} x PP{layout.pp} x DP{layout.dp}{' + EP' if layout.ep else ''}",
                          "gpus": layout.gpus, "kv_tokens": record.kv_capacity_tokens} if layout else None
    tokens = [record.kv_capacity_tokens for record in chosen.values()]
    row["ratio"] = round(tokens[0] / tokens[1], 2) if tokens[0] and tokens[1] else None
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()
