"""Training throughput: the appliance's trainer (finetune.train: TRL's SFT trainer + PEFT LoRA,
loss on completions only) against a plain PEFT + Transformers loop (AdamW, padded batches in
order, loss on completions only) on the same model: the same rows for one epoch in batches of the
same size, the same LoRA, the same real tokens, taking turns twice. Each run is its own process,
so its peak RSS (and on a GPU its peak GPU memory) is its own.

Reports real training tokens/s (tokens fed to the model, padding excluded, over the seconds spent
training: loading and evaluation excluded), peak RSS and the ratios appliance / plain. On a GPU
host the same script measures LoRA and QLoRA there.

Run: .venv/bin/python -m bench.finetune_throughput [--model DIR] [--steps N] [--qlora]
(N batches of training rows, one epoch.) Writes bench/results/finetune_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "finetune_throughput.json"
ROUNDS = 2
BATCH = 4
HELD_OUT = 8  # rows the appliance evaluates on (not timed)


def rows(steps: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`steps` batches of training rows, and the held-out rows."""
    made = [{"messages": [{"role": "user", "content": f"Which shelf holds item {i} of the {i % 7}th aisle?"},
                          {"role": "assistant", "content": f"Item {i} sits on shelf {i % 5} in aisle {i % 7}, "
                                                           "next to the blue crates."}]}
            for i in range(steps * BATCH + HELD_OUT)]
    return made[:-HELD_OUT], made[-HELD_OUT:]


def appliance_run(model: Path, steps: int, qlora: bool) -> dict[str, float]:
    from appliance.jobs import Hyperparameters
    from finetune.train import train_adapter

    with tempfile.TemporaryDirectory() as work:
        result = train_adapter(model, *rows(steps), Path(work), Hyperparameters(
            epochs=1, batch_size=BATCH, save_steps=10_000, qlora=qlora, learning_rate=1e-4))
    assert result is not None, "one process is rank 0, which gets the result"
    assert result.steps == steps, f"{result.steps} steps, not {steps}"
    return {"tokens": result.train_tokens, "seconds": result.seconds}


def plain_run(model_dir: Path, steps: int, qlora: bool) -> dict[str, float]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from appliance.jobs import Hyperparameters
    from finetune.train import _quantization  # the same 4-bit config when --qlora

    hp = Hyperparameters(qlora=qlora)  # the LoRA the appliance trains by default
    # Any: transformers' and PEFT's annotations do not follow a model through get_peft_model.
    tokenizer: Any = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32,
                                                 **_quantization(hp))
    # On a GPU, as a user would write it: the model there and bf16 autocast (the appliance's trainer
    # turns that on too); a 4-bit model is placed on the GPU as it loads.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not qlora:
        model = model.to(device)
    model = get_peft_model(model, LoraConfig(r=hp.rank, lora_alpha=hp.alpha, lora_dropout=hp.dropout,
                                             target_modules="all-linear", task_type="CAUSAL_LM"))
    examples = []
    for row in rows(steps)[0]:
        prompt = tokenizer.apply_chat_template(row["messages"][:1], add_generation_prompt=True,
                                               return_dict=True)["input_ids"]
        whole = tokenizer.apply_chat_template(row["messages"], return_dict=True)["input_ids"]
        examples.append((whole, len(prompt)))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model.train()
    tokens, started = 0, time.monotonic()
    for step in range(steps):
        batch = examples[step * BATCH:(step + 1) * BATCH]
        width = max(len(ids) for ids, _ in batch)
        pad = tokenizer.pad_token_id or tokenizer.eos_token_id
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in batch], device=device)
        mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch], device=device)
        labels = torch.tensor([[-100] * cut + ids[cut:] + [-100] * (width - len(ids)) for ids, cut in batch],
                              device=device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        tokens += int(mask.sum())
    if device == "cuda":
        torch.cuda.synchronize()
    return {"tokens": tokens, "seconds": time.monotonic() - started}


def measured(mode: str, model: Path, steps: int, qlora: bool) -> dict[str, float]:
    """One run in its own process: its figures, its peak RSS and, on a GPU, its peak GPU memory."""
    command = [sys.executable, __file__, "--child", mode, "--model", str(model), "--steps", str(steps),
               *(["--qlora"] if qlora else [])]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the {mode} run failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    figures["tokens_per_s"] = figures["tokens"] / figures["seconds"]
    return figures


def peaks() -> dict[str, int]:
    """This process's peak RSS (its children's included: Linux reports KiB) and peak GPU memory."""
    import resource

    import torch

    kib = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    found = {"peak_rss_bytes": kib * 1024}
    if torch.cuda.is_available():
        found["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: the demo model)")
    parser.add_argument("--steps", type=int, default=20, help="batches of training rows (one epoch)")
    parser.add_argument("--qlora", action="store_true")
    parser.add_argument("--child", choices=("appliance", "plain"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        from appliance.home import Home

        args.model = Home.from_env().demo_model
    if args.child:
        run = appliance_run if args.child == "appliance" else plain_run
        print(json.dumps({**run(args.model, args.steps, args.qlora), **peaks()}))
        return
    runs: dict[str, list[dict[str, float]]] = {"appliance": [], "plain": []}
    for round_ in range(ROUNDS):
        for mode in (("appliance", "plain") if round_ % 2 == 0 else ("plain", "appliance")):
            runs[mode].append(measured(mode, args.model, args.steps, args.qlora))
            print(mode, json.dumps(runs[mode][-1]), flush=True)
    tokens = {r["tokens"] for found in runs.values() for r in found}
    if len(tokens) != 1:
        raise SystemExit(f"the runs did not train on the same real tokens: {runs}")
    rate = {mode: statistics.median(r["tokens_per_s"] for r in found) for mode, found in runs.items()}
    peak = {mode: max(r["peak_rss_bytes"] for r in found) for mode, found in runs.items()}
    row = {"model": args.model.name, "qlora": args.qlora, "steps": args.steps, "batch_size": BATCH, "epochs": 1,
           "real_tokens": tokens.pop(),
           "appliance_tokens_per_s": round(rate["appliance"], 1), "plain_tokens_per_s": round(rate["plain"], 1),
           "throughput_ratio": round(rate["appliance"] / rate["plain"], 2),
           "appliance_peak_rss_bytes": peak["appliance"], "plain_peak_rss_bytes": peak["plain"],
           "memory_ratio": round(peak["appliance"] / peak["plain"], 2)}
    if all("peak_gpu_bytes" in r for found in runs.values() for r in found):
        gpu = {mode: max(r["peak_gpu_bytes"] for r in found) for mode, found in runs.items()}
        row.update({"appliance_peak_gpu_bytes": gpu["appliance"], "plain_peak_gpu_bytes": gpu["plain"],
                    "gpu_memory_ratio": round(gpu["appliance"] / gpu["plain"], 2)})
    print(json.dumps(row, indent=1))
    existing = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    key = f"{'cuda' if _has_cuda() else 'cpu'}-{'qlora' if args.qlora else 'lora'}"
    existing[key] = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     "host_cpus": len(os.sched_getaffinity(0)), "rounds": ROUNDS, **row}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(existing, indent=2) + "\n")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
