"""A trainer's CPU work next to a busy neighbour: OpenMP's default waiting (threads spin at each
barrier) against passive waiting (OMP_WAIT_POLICY=PASSIVE, what the appliance's trainers run with,
finetune.sandbox.TRAINER_ENVIRONMENT), each alone and beside a process that keeps every core busy
with matrix products, as a CPU engine decoding does. The work is what the gate does after training:
the demo model answering the shipped regression set (32 prompts, 48 new tokens, greedy) in one
generate call. Each measurement is its own process; the four cases take turns, ROUNDS times.

Run: .venv/bin/python -m bench.cpu_contention. Writes bench/results/cpu_contention.json.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "cpu_contention.json"
ROUNDS = 3

GENERATE = """
import json, time
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from appliance.home import Home
from finetune.evalsets import SHIPPED_REGRESSION
from finetune.train import ANSWER_TOKENS
model_dir = Home.from_env().demo_model
tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
tokenizer.padding_side = "left"
model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).eval()
items = [json.loads(line) for line in SHIPPED_REGRESSION.read_text().splitlines()]
prompts = [tokenizer.apply_chat_template([{"role": "user", "content": item["prompt"]}], add_generation_prompt=True,
                                         return_dict=True)["input_ids"] for item in items]
inputs = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
started = time.monotonic()
with torch.no_grad():
    model.generate(**inputs, max_new_tokens=ANSWER_TOKENS, pad_token_id=tokenizer.pad_token_id, do_sample=False)
print(json.dumps({"seconds": time.monotonic() - started, "threads": torch.get_num_threads()}))
"""

# Every core busy with float32 matrix products in torch's own threads, until killed.
NEIGHBOUR = """
import torch
a = torch.randn(512, 512)
while True:
    a = torch.tanh(a @ a)
"""


def generate(policy: str | None) -> float:
    """Seconds of one generate call, in a process of its own with OMP_WAIT_POLICY=policy (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    done = subprocess.run([sys.executable, "-c", GENERATE], env=env, capture_output=True, text=True, check=True)
    seconds: float = json.loads(done.stdout.strip().splitlines()[-1])["seconds"]
    return seconds


def measure(policy: str | None, busy: bool) -> float:
    if not busy:
        return generate(policy)
    neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR])
    try:
        time.sleep(2)  # its threads are up and multiplying
        return generate(policy)
    finally:
        neighbour.kill()
        neighbour.wait()


def main() -> None:
    cases = [("spin", None, False), ("passive", "PASSIVE", False), ("spin", None, True), ("passive", "PASSIVE", True)]
    runs: dict[str, list[float]] = {}
    for round_ in range(ROUNDS):
        for name, policy, busy in (cases if round_ % 2 == 0 else cases[::-1]):
            key = f"{name}_{'busy' if busy else 'alone'}_s"
            runs.setdefault(key, []).append(round(measure(policy, busy), 2))
            print(key, runs[key][-1], flush=True)
    median = {key: statistics.median(found) for key, found in runs.items()}
    result = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host_cpus": len(os.sched_getaffinity(0)),
        "rounds": ROUNDS, "runs": runs, "median_s": median,
        "spin_slowdown_next_to_busy": round(median["spin_busy_s"] / median["spin_alone_s"], 2),
        "passive_slowdown_next_to_busy": round(median["passive_busy_s"] / median["passive_alone_s"], 2),
        "passive_vs_spin_next_to_busy": round(median["spin_busy_s"] / median["passive_busy_s"], 2),
        "passive_vs_spin_alone": round(median["spin_alone_s"] / median["passive_alone_s"], 2),
    }
    print(json.dumps(result, indent=1))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
