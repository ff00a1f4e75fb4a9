"""Sharded training on one host: what each rank holds with FSDP2 (finetune.sharded) at 1, 2 and
4 ranks, and its training tokens/s against DDP (TRL's trainer under torchrun, every rank holding
the whole base) on the same rows, global batch and LoRA, at 2 ranks, taking turns.

Each run is the appliance's own trainer command (`python -m finetune.job DIR`, under torchrun, as
finetune.runner starts it, without the sandbox). Per rank: its shards of the base and of the
adapter and its optimizer state as the rank measured them (DIR/ranks/rank-N.json, FSDP only), and
its peak resident memory, sampled from outside for both strategies (every 0.1 s: a peak between
two samples is missed). Tokens/s: the trainer's own figure (tokens fed, padding excluded, over the
seconds spent training; loading and evaluation excluded).

With --qlora the same runs train QLoRA: the base's decoder linears in NF4 (FSDP2 shards their
packed storage; each rank's base bytes are what it holds packed), on both sides.

Run: .venv/bin/python -m bench.finetune_sharded [--model DIR] [--steps N] [--qlora]
Writes bench/results/finetune_sharded.json (finetune_sharded_qlora.json with --qlora).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import psutil

from appliance.home import Home
from appliance.jobs import Hyperparameters, read_ranks
from finetune.runner import _trainer_command
from finetune.sandbox import TRAINER_ENVIRONMENT
from finetune.train import TrainingSpec

RESULTS = Path(__file__).parent / "results"
GLOBAL_BATCH = 4
ROUNDS = 2  # FSDP and DDP at 2 ranks, taking turns


def rows(count: int) -> list[dict[str, Any]]:
    return [{"messages": [{"role": "user", "content": f"Which shelf holds item {i} of the {i % 7}th aisle?"},
                          {"role": "assistant", "content": f"Item {i} sits on shelf {i % 5} in aisle {i % 7}, "
                                                           "next to the blue crates."}]} for i in range(count)]


def peak_rss(process: subprocess.Popen[bytes], found: dict[int, int]) -> None:
    """Each training process's largest resident set seen (the ranks: torchrun's children)."""
    root = psutil.Process(process.pid)
    while process.poll() is None:
        try:
            for child in root.children(recursive=True):
                if "finetune.job" in child.cmdline() and "torch.distributed.run" not in child.cmdline():
                    found[child.pid] = max(found.get(child.pid, 0), child.memory_info().rss)
        except psutil.Error:
            pass
        threading.Event().wait(0.1)


def run(model: Path, strategy: str, ranks: int, steps: int, qlora: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as work:
        directory = Path(work)
        data = rows(steps * GLOBAL_BATCH + 8)
        for split, part in (("train", data[:-8]), ("eval", data[-8:])):
            (directory / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
        hp = Hyperparameters(max_steps=steps, batch_size=GLOBAL_BATCH // ranks, save_steps=10_000, max_length=128,
                             learning_rate=1e-4, processes=ranks, qlora=qlora)
        strategy_run = "single" if strategy == "ddp" and ranks == 1 else strategy
        (directory / "job.json").write_text(TrainingSpec(base=model.resolve(), hyperparameters=hp,
                                                         strategy=strategy_run).model_dump_json())
        command = _trainer_command(directory, ranks, strategy_run, cpu=True)  # type: ignore[arg-type]
        with (directory / "train.log").open("wb") as log:
            child = subprocess.Popen(command, cwd=directory, stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **TRAINER_ENVIRONMENT})
            found: dict[int, int] = {}
            watcher = threading.Thread(target=peak_rss, args=(child, found))
            watcher.start()
            child.wait()
            watcher.join()
        if child.returncode != 0:
            raise SystemExit(f"{strategy} x {ranks} failed:\n" + (directory / "train.log").read_text()[-3000:])
        result = json.loads((directory / "result.json").read_text())
        reports = read_ranks(directory)
        return {"strategy": strategy, "ranks": ranks, "tokens_per_s": result["train_tokens"] / result["seconds"],
                "train_tokens": result["train_tokens"], "seconds": result["seconds"],
                "peak_rss_bytes_sampled": sorted(found.values()),
                "rank_reports": [r.model_dump() for r in reports]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Home.from_env().demo_model)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--qlora", action="store_true", help="train QLoRA (NF4 base) on both sides")
    args = parser.parse_args()
    runs = [run(args.model, "fsdp", ranks, args.steps, args.qlora) for ranks in (1, 4)]
    for _ in range(ROUNDS):
        runs += [run(args.model, "fsdp", 2, args.steps, args.qlora), run(args.model, "ddp", 2, args.steps, args.qlora)]
    for found in runs:
        reports = found["rank_reports"]
        print(f"{found['strategy']} x {found['ranks']}: {found['tokens_per_s']:.0f} tokens/s; peak RSS per rank "
              f"{[round(b / 2**20) for b in found['peak_rss_bytes_sampled']]} MiB; base shard per rank "
              f"{[round(r['base_parameter_bytes'] / 2**20) for r in reports]} MiB; optimizer per rank "
              f"{[round(r['optimizer_bytes'] / 2**20, 1) for r in reports]} MiB")
    fsdp = [r["tokens_per_s"] for r in runs if r["strategy"] == "fsdp" and r["ranks"] == 2]
    ddp = [r["tokens_per_s"] for r in runs if r["strategy"] == "ddp"]
    ratio = statistics.median(fsdp) / statistics.median(ddp)
    rss = {s: statistics.median(max(r["peak_rss_bytes_sampled"]) for r in runs
                                if r["strategy"] == s and r["ranks"] == 2) for s in ("fsdp", "ddp")}
    print(f"2 ranks: FSDP {statistics.median(fsdp):.0f} vs DDP {statistics.median(ddp):.0f} tokens/s ({ratio:.2f} x); "
          f"peak RSS a rank {rss['fsdp'] / 2**20:.0f} vs {rss['ddp'] / 2**20:.0f} MiB "
          f"({rss['fsdp'] / rss['ddp']:.2f} x)")
    out = RESULTS / f"finetune_sharded{'_qlora' if args.qlora else ''}.json"
    out.write_text(json.dumps({"model": str(args.model), "qlora": args.qlora, "steps": args.steps,
                               "global_batch": GLOBAL_BATCH,
                                   "runs": runs, "fsdp_over_ddp_tokens_per_s": ratio,
                                   "fsdp_over_ddp_peak_rss": rss["fsdp"] / rss["ddp"]}, indent=1))


if __name__ == "__main__":
    main()
