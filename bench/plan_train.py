"""`plan --train`: the GPUs and hosts a LoRA/QLoRA run of DeepSeek-V3, Kimi-K2 and Llama-3.1-405B
needs on H200 hosts (8 x 141 GiB), beside the arithmetic a reader would do first (the base's bytes
over a GPU's budget: the ratio says what the rest of a rank's memory costs), the time a training
plan takes against a serving plan of the same model and hardware (the ratio), and the estimate
for one CPU rank against the peak RSS measured of a plain LoRA loop on the demo model (the ratio).

Run: .venv/bin/python -m bench.plan_train [--no-measure: plans only, the last measurement kept]
Writes bench/results/plan_train.json.
"""

from __future__ import annotations

import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from appliance.job_fit import CPU_MMAP_THRESHOLD
from installer.hardware import parse_hardware_spec
from installer.memory import GIB, count_params
from installer.model_config import load_model_config
from installer.planner import plan
from installer.train_memory import NF4_PACKED, NF4_STATE, TrainSpec, rank_memory
from installer.train_plan import GPU_UTILIZATION, plan_training

ROOT = Path(__file__).parent.parent
CONFIGS = ROOT / "tests" / "data" / "model_configs"
RESULTS = Path(__file__).parent / "results" / "plan_train.json"
HARDWARE = "2x8xH200-141GB"
MODELS = ("deepseek-v3", "kimi-k2", "llama-3.1-405b")
RANK, SEQ_LEN, BATCH = 16, 4096, 1
REPEATS = 20
DEMO = Path("/var/lib/appliance/models/SmolLM2-135M-Instruct")
MEASURED = [(256, 2), (512, 2)]  # (tokens a row, rows a step) of the demo-model runs
STEPS = 3


def naive_gpus(model: str, method: str) -> tuple[int, int]:
    """The reader's arithmetic: every parameter in bf16 (LoRA) or NF4 with its quant state (QLoRA),
    over one GPU's budget; and the base's bytes."""
    total = count_params(load_model_config(CONFIGS / f"{model}.json")).total
    base = total * (2 if method == "lora" else NF4_PACKED + NF4_STATE)
    budget = 141 * GIB * GPU_UTILIZATION
    return math.ceil(base / budget), int(base)


def planned(model: str, method: str) -> dict[str, object]:
    shape, profile = load_model_config(CONFIGS / f"{model}.json"), parse_hardware_spec(HARDWARE)
    spec = TrainSpec(method="lora" if method == "lora" else "qlora", rank=RANK, seq_len=SEQ_LEN, batch=BATCH)
    times, serve_times = [], []
    for _ in range(REPEATS):  # the two take turns
        started = time.perf_counter()
        record = plan_training(shape, profile, spec)
        times.append(time.perf_counter() - started)
        started = time.perf_counter()
        plan(shape, profile, context=8192, concurrency=1)
        serve_times.append(time.perf_counter() - started)
    layout, per_rank = record.layout or {}, record.per_rank or {}
    naive, base = naive_gpus(model, method)
    gpus = layout.get("ranks")
    row: dict[str, object] = {
        "model": model, "method": method, "hardware": HARDWARE, "rank": RANK, "seq_len": SEQ_LEN, "batch": BATCH,
        "gpus": gpus, "hosts": layout.get("hosts"), "fits_here": record.feasible,
        "checkpointing": record.checkpointing,
        "per_rank_gib": {k: round(v / GIB, 1) for k, v in per_rank.items()},
        "naive_base_bytes": base, "naive_gpus": naive, "ratio_to_naive": round(gpus / naive, 2) if gpus else None,
        "seconds": round(statistics.median(times), 5), "serving_plan_seconds": round(statistics.median(serve_times), 5),
        "ratio_to_serving_plan": round(statistics.median(times) / statistics.median(serve_times), 2),
        "rejected": len(record.rejected)}
    print(json.dumps({k: v for k, v in row.items() if k != "per_rank_gib"}), flush=True)
    return row


def measure_child(seq_len: int, batch: int) -> None:
    """A plain LoRA loop on the demo model on this CPU, in fp32 as the trainer loads it: PEFT's
    all-linear LoRA (rank 8, dropout 0.05), AdamW, STEPS steps on random tokens; prints the RSS
    after the imports and the peak."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    imported = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(DEMO, local_files_only=True, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules="all-linear",
                                             task_type="CAUSAL_LM"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
    model.train()
    for _ in range(STEPS):
        ids = torch.randint(0, base.config.vocab_size, (batch, seq_len))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    print(json.dumps({"imported_rss": imported, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def measured(seq_len: int, batch: int) -> dict[str, object]:
    """The child's peak RSS with glibc's default malloc, whose dynamic mmap threshold keeps freed
    activations in the heap, and with the trainer's fixed threshold (MALLOC_MMAP_THRESHOLD_), which
    returns the larger ones: the second is what the estimate models."""
    peaks = {}
    fixed = {"MALLOC_MMAP_THRESHOLD_": str(CPU_MMAP_THRESHOLD)}
    for name, extra in (("default_malloc", {}), ("fixed_mmap_threshold", fixed)):
        done = subprocess.run([sys.executable, __file__, "--child", str(seq_len), str(batch)], capture_output=True,
                              text=True, check=True,
                              env={**os.environ, "OMP_NUM_THREADS": str(len(os.sched_getaffinity(0))), **extra})
        peaks[name] = json.loads(done.stdout.strip().splitlines()[-1])
    demo = load_model_config(DEMO)
    spec = TrainSpec(method="lora", rank=8, seq_len=seq_len, batch=batch)
    estimate = rank_memory(demo, spec, ranks=1, device="cpu", checkpointing=False)
    row: dict[str, object] = {"model": "SmolLM2-135M-Instruct", "seq_len": seq_len, "batch": batch, "steps": STEPS,
                              "estimate_total": estimate.total, "estimate": estimate.figures()}
    for name, found in peaks.items():
        row[name] = {"peak_rss": found["peak_rss"], "imported_rss": found["imported_rss"],
                     "ratio": round(estimate.total / found["peak_rss"], 3)}
    print(json.dumps(row), flush=True)
    return row


def main(measure: bool) -> None:
    rows = [planned(model, method) for model in MODELS for method in ("lora", "qlora")]
    if measure and DEMO.is_dir():
        cpu = [measured(*case) for case in MEASURED]
    else:  # keep the last measurement: --no-measure replans only
        cpu = json.loads(RESULTS.read_text()).get("cpu_estimate_vs_measured", []) if RESULTS.is_file() else []
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"bench": "plan_train", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                   "host_cpus": len(os.sched_getaffinity(0)), "rows": rows,
                                   "cpu_estimate_vs_measured": cpu}, indent=2) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        measure_child(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main(measure="--no-measure" not in sys.argv[1:])
