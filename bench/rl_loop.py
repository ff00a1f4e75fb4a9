"""The RL loop (execution feedback), measured.

- sandbox: executions per second with full isolation (finetune.rl.execute: each execution in
  namespaces, a tmpfs and a user of its own with its limits, forked by a sandbox cell's zygote as a
  sandbox worker does, the harness running each test in a child) against a bare `subprocess.run`
  of the same program and tests in one Python process, one at a time, taking turns, in this
  invocation; and the same through the run's worker pool (one sandbox worker per core,
  finetune.rl.executor, started on a first batch: `workers_start_s`) against bare runs as many at
  once.
- loop (--loop; starts an appliance of its own: Keycloak, the demo model's engine, the gateway, the
  rl-worker): one iteration over the starter set's train tasks (2 answers each, no correction),
  pipelined (`appliance rl run`: answers go to the sandbox workers as they arrive) against
  sequential (every answer first, through the same gateway at the same concurrency, then every
  execution on the same worker pool), taking turns; then one policy update (a run with corrections,
  its SFT set, a LoRA adapter trained on it, deployed) and held-out pass@1 before and after, over
  three seeds (`appliance rl gate`).
- grpo (--grpo; an appliance of its own too): online GRPO on HumanEval's train split, each step's
  time split into sampling (generation and execution) and update, and held-out pass@1 of the base
  model against the last policy version on HumanEval's held-out fifth, with the difference's 95 %
  interval; set beside the executions per second against bare runs above (same invocation).
- grpo_learning (--grpo-learning; an appliance of its own): the same on the starter set, which the
  demo model solves part of the time (so that a group's rewards differ and the policy moves), over
  more steps: rewards and pass rate by step, held-out pass@1 before and after.

Run: .venv/bin/python -m bench.rl_loop [--executions N] [--loop] [--grpo] [--grpo-learning]
     (as root, after ./bootstrap.sh --no-start)
Writes bench/results/rl_loop.json.
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

from appliance.home import Home
from appliance.settings import ExecutionSettings
from finetune.rl.execute import Sandbox

RESULTS = Path(__file__).parent / "results" / "rl_loop.json"
ROUNDS = 5


def programs(count: int) -> list[tuple[str, str]]:
    """Small solutions with two tests each, one in four wrong (as model answers are)."""
    made = []
    for i in range(count):
        wrong = " + 1" if i % 4 == 3 else ""
        program = f"def solve(xs):\n    return sorted(xs)[-{1 + i % 3}] * {i}{wrong}\n"
        pick = f"[-{1 + i % 3}] * {i}"
        tests = (f"def test_small():\n    assert solve([3, 1, 2, 5]) == sorted([3, 1, 2, 5]){pick}\n\n"
                 f"def test_big():\n    xs = list(range({100 + i}))\n    assert solve(xs) == sorted(xs){pick}\n")
        made.append((program, tests))
    return made


def bare(program: str, tests: str) -> bool:
    """The same program and tests with no isolation at all: one Python process runs both."""
    script = f"{program}\n{tests}\ntest_small()\ntest_big()\n"
    return subprocess.run([sys.executable, "-I", "-S", "-c", script], capture_output=True).returncode == 0


def sandboxed(program: str, tests: str, sandbox: Sandbox) -> bool:
    return sandbox.run(program, "python", tests=tests).status == "passed"


def pool_rates(work: list[tuple[str, str]], home: Home, scratch: Path, workers: int) -> dict[str, float]:
    """Executions per second through the worker pool (`workers` sandbox workers) and bare runs as many
    at once, taking turns."""
    from concurrent.futures import ThreadPoolExecutor

    from appliance.rl.tasks import Task
    from finetune.rl.executor import WorkerPool
    from finetune.rl.store import RunStore

    rates: dict[str, list[float]] = {"bare_parallel": [], "sandbox_pool": [], "workers_start_s": []}
    for turn in range(ROUNDS):
        started = time.monotonic()
        with ThreadPoolExecutor(workers) as threads:
            list(threads.map(lambda pair: bare(*pair), work))
        rates["bare_parallel"].append(len(work) / (time.monotonic() - started))
        store = RunStore(scratch / f"pool-{turn}.sqlite")
        pool = WorkerPool(store, home, workers)
        # Workers (and their cells) start with a run's first executions and live while it has
        # more: started on a first batch (timed apart), measured on the next.
        for batch, pairs in (("warm-up", work[:2 * workers]), ("measured", work)):
            for index, (program, tests) in enumerate(pairs):
                store.enqueue(f"{batch}-{index}", program, Task(id=str(index), prompt="-", tests=tests))
            started = time.monotonic()
            while store.unfinished():
                pool.follow(store.depth())
                time.sleep(0.01)
            if batch == "warm-up":
                rates["workers_start_s"].append(time.monotonic() - started)
        rates["sandbox_pool"].append(len(work) / (time.monotonic() - started))
        pool.stop()
    return {name: round(statistics.median(values), 2 if name.endswith("_s") else 1) for name, values in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executions", type=int, default=160)  # a worker's first poll (50 ms) does not weigh
    parser.add_argument("--loop", action="store_true", help="Also measure the loop on an appliance of its own.")
    parser.add_argument("--grpo", action="store_true", help="Also measure online GRPO on an appliance of its own.")
    parser.add_argument("--grpo-learning", action="store_true",
                        help="Also run GRPO where the demo model can learn (the starter set), on an appliance "
                             "of its own.")
    args = parser.parse_args()
    settings = ExecutionSettings()
    work = programs(args.executions)
    rates: dict[str, list[float]] = {"bare": [], "sandbox": []}
    agree = True
    with Sandbox(settings) as sandbox:  # one cell, as one sandbox worker keeps
        for _ in range(ROUNDS):
            for name in ("bare", "sandbox"):
                started = time.monotonic()
                verdicts = [bare(p, t) if name == "bare" else sandboxed(p, t, sandbox) for p, t in work]
                rates[name].append(len(work) / (time.monotonic() - started))
                agree = agree and verdicts == [i % 4 != 3 for i in range(len(work))]
    result = {
        "executions_per_round": len(work), "rounds": ROUNDS, "verdicts_agree": agree,
        "bare_per_s": round(statistics.median(rates["bare"]), 1),
        "sandbox_per_s": round(statistics.median(rates["sandbox"]), 1),
        "ratio": round(statistics.median(rates["sandbox"]) / statistics.median(rates["bare"]), 2),
        "all": {name: [round(r, 1) for r in values] for name, values in rates.items()},
    }
    workers = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="rl-bench-") as scratch:
        pooled = pool_rates(work, Home.from_env(), Path(scratch), workers)
    result["pool"] = {"workers": workers, **pooled,
                      "ratio": round(pooled["sandbox_pool"] / pooled["bare_parallel"], 2)}
    if args.loop:
        from bench.rl_loop_appliance import measure_loop

        result["loop"] = measure_loop()
    if args.grpo:
        from bench.rl_loop_appliance import measure_grpo

        result["grpo"] = measure_grpo()
    if args.grpo_learning:
        from bench.rl_loop_appliance import LEARNING_STEPS, measure_grpo

        result["grpo_learning"] = measure_grpo("starter", LEARNING_STEPS)
    earlier = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    for part in ("loop", "grpo", "grpo_learning"):
        if part not in result and part in earlier:
            result[part] = earlier[part]  # kept from the run that measured it
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
