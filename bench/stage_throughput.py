"""Staging throughput: a synthetic Llama-shaped checkpoint of about 4 GB (made here, deleted after),
staged `subset` for a one-host plan (every byte copied, every output file fsynced and its SHA-256
taken, manifest written) against `cp -r` of the same files on the same disk, and against `cp -r`
followed by `sync -f` (a copy as durable as staging's), taking turns twice; and the staging
process's peak RSS (GNU time) against the largest tensor.

Run: .venv/bin/python bench/stage_throughput.py   Writes bench/results/stage_throughput.json.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from installer.hardware import parse_hardware_spec
from installer.model_config import load_model_config
from installer.planner import plan

ROOT = Path(__file__).parent.parent
RESULTS = Path(__file__).parent / "results" / "stage_throughput.json"
APPLIANCE = str(Path(sys.executable).with_name("appliance"))
HIDDEN, INTER, LAYERS, VOCAB = 4096, 11008, 9, 32000
ROUNDS = 2


def make_checkpoint(directory: Path) -> tuple[int, int]:
    """(total bytes, largest tensor bytes) of a checkpoint written one layer per file."""
    directory.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN, "intermediate_size": INTER,
              "num_hidden_layers": LAYERS, "num_attention_heads": 32, "num_key_value_heads": 32,
              "vocab_size": VOCAB, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    (directory / "config.json").write_text(json.dumps(config))
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "lm_head.weight": (VOCAB, HIDDEN),
              "model.norm.weight": (HIDDEN,)}
    files = [dict(shapes)]
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        files.append({f"{p}.self_attn.{n}.weight": (HIDDEN, HIDDEN) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
                     | {f"{p}.mlp.{n}.weight": (INTER, HIDDEN) for n in ("gate_proj", "up_proj")}
                     | {f"{p}.mlp.down_proj.weight": (HIDDEN, INTER),
                        f"{p}.input_layernorm.weight": (HIDDEN,), f"{p}.post_attention_layernorm.weight": (HIDDEN,)})
    weight_map, total, largest = {}, 0, 0
    generator = torch.Generator().manual_seed(0)
    for number, tensors in enumerate(files):
        name = f"model-{number + 1:05d}-of-{len(files):05d}.safetensors"
        data = {n: torch.randint(-30000, 30000, s, generator=generator, dtype=torch.int16).view(torch.bfloat16)
                for n, s in tensors.items()}
        save_file(data, directory / name)
        weight_map |= {n: name for n in tensors}
        total += (directory / name).stat().st_size
        largest = max(largest, *(t.numel() * 2 for t in data.values()))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return total, largest


def timed(command: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS in bytes of a command, measured by GNU time (RSS after exec only:
    a fork of this process would count its tensors)."""
    report = tempfile.NamedTemporaryFile(suffix=".time")
    started = time.perf_counter()
    subprocess.run(["/usr/bin/time", "-o", report.name, "-f", "%M", *command], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seconds = time.perf_counter() - started
    return seconds, int(Path(report.name).read_text().split()[-1]) * 1024


def main() -> None:
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # unwind: clean up
    work = Path(tempfile.mkdtemp(prefix="stage-bench-", dir=ROOT))
    try:
        source = work / "source"
        total, largest = make_checkpoint(source)
        record = plan(load_model_config(source), parse_hardware_spec("1x1xH100-80GB"), context=2048, concurrency=1)
        plan_file = work / "plan.json"
        plan_file.write_text(record.model_dump_json())
        stage_s, copy_s, durable_s, peaks = [], [], [], []
        for round_ in range(ROUNDS):
            seconds, _ = timed(["cp", "-r", str(source), str(work / f"cp-{round_}")])
            copy_s.append(seconds)
            shutil.rmtree(work / f"cp-{round_}")
            target = work / f"cp-sync-{round_}"
            seconds, _ = timed(["sh", "-c", f"cp -r '{source}' '{target}' && sync -f '{target}'"])
            durable_s.append(seconds)
            shutil.rmtree(target)
            seconds, peak = timed([APPLIANCE, "stage", str(source), "--plan", str(plan_file),
                                   "--out", str(work / f"staged-{round_}")])
            stage_s.append(seconds)
            peaks.append(peak)
            shutil.rmtree(work / f"staged-{round_}")
        stage, copy, durable = (statistics.median(v) for v in (stage_s, copy_s, durable_s))
        row = {"bytes": total, "stage_seconds": round(stage, 2), "cp_seconds": round(copy, 2),
               "cp_sync_seconds": round(durable, 2), "stage_mb_per_s": round(total / stage / 1e6),
               "cp_mb_per_s": round(total / copy / 1e6), "cp_sync_mb_per_s": round(total / durable / 1e6),
               "ratio_vs_cp": round(copy / stage, 2), "ratio_vs_cp_sync": round(durable / stage, 2),
               "peak_rss_bytes": max(peaks), "largest_tensor_bytes": largest,
               "rss_over_largest_tensor": round(max(peaks) / largest, 2)}
        print(json.dumps(row))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"bench": "stage_throughput", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                   "host_cpus": len(os.sched_getaffinity(0)), "format": "subset", "rounds": ROUNDS,
                                   "note": "stage = copy_file_range + fsync + SHA-256 of each output + "
                                           "manifest; cp = coreutils cp -r (page cache); cp_sync = cp -r then "
                                           "sync -f", **row}, indent=2) + "\n")


if __name__ == "__main__":
    main()
