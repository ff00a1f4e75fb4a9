"""Staging throughput: a synthetic Llama-shaped checkpoint of about 4 GB (made here, deleted after),
staged `subset` and `sharded` for a one-host plan (every byte copied, every output file fsynced and
its SHA-256 taken, manifest written) against `cp -r` of the same files on the same disk, and against `cp -r`
followed by `sync -f` (a copy as durable as staging's), taking turns four times, each first
once (the disk is shared and noisy); and the staging
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
from collections.abc import Callable
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
ROUNDS = 4


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
    weight_map: dict[str, str] = {}
    total, largest = 0, 0
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
        runs: dict[str, list[float]] = {"cp": [], "cp_sync": [], "subset": [], "sharded": []}
        peaks: dict[str, list[int]] = {}

        def stage(fmt: str) -> Callable[[Path], list[str]]:
            return lambda target: [APPLIANCE, "stage", str(source), "--plan", str(plan_file), "--out", str(target),
                                   "--format", fmt]

        commands: dict[str, Callable[[Path], list[str]]] = {
            "cp": lambda target: ["cp", "-r", str(source), str(target)],
            "cp_sync": lambda target: ["sh", "-c", f"cp -r '{source}' '{target}' && sync -f '{target}'"],
            **{fmt: stage(fmt) for fmt in ("subset", "sharded")}}
        names = list(commands)
        for round_ in range(ROUNDS):
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:  # each goes first once
                target = work / f"{name}-{round_}"
                seconds, peak = timed(commands[name](target))
                runs[name].append(seconds)
                peaks.setdefault(name, []).append(peak)
                shutil.rmtree(target)
        median = {name: statistics.median(values) for name, values in runs.items()}
        row: dict[str, float] = {"bytes": total, "largest_tensor_bytes": largest,
               **{f"{name}_seconds": round(value, 2) for name, value in median.items()},
               **{f"{name}_mb_per_s": round(total / value / 1e6) for name, value in median.items()}}
        for fmt in ("subset", "sharded"):
            row |= {f"{fmt}_ratio_vs_cp": round(median["cp"] / median[fmt], 2),
                    f"{fmt}_ratio_vs_cp_sync": round(median["cp_sync"] / median[fmt], 2),
                    f"{fmt}_peak_rss_bytes": max(peaks[fmt]),
                    f"{fmt}_rss_over_largest_tensor": round(max(peaks[fmt]) / largest, 2)}
        print(json.dumps(row, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"bench": "stage_throughput",
                                   "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                   "host_cpus": len(os.sched_getaffinity(0)), "rounds": ROUNDS,
                                   "note": "subset = copy_file_range, then fsync while SHA-256 of each output; "
                                           "sharded = vLLM sharded_state files (TP=1, parts <= 2 GiB built in "
                                           "memory), fsync while SHA-256 of file and tensors; both write the "
                                           "manifest; cp = coreutils cp -r (page cache); cp_sync = cp -r then "
                                           "sync -f", **row}, indent=2) + "\n")


if __name__ == "__main__":
    main()
