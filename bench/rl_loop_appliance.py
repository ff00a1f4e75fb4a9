"""bench/rl_loop.py --loop and --grpo: the loop measured on an appliance of its own (embedded
Keycloak, the demo model's engine, the gateway, the rl-worker), started here and taken down after."""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from appliance.artifacts import artifact_store
from appliance.home import Home
from appliance.jobs import FINISHED
from appliance.rl import runs
from appliance.rl.progress import read_progress
from appliance.secrets import secret
from appliance.settings import Settings, load_settings
from bench.own_appliance import APPLIANCE, cli, own_appliance
from finetune.rl.executor import WorkerPool
from finetune.rl.loop import Generator, Step, extract_code, first_messages
from finetune.rl.store import RunStore
from finetune.rl.tasks import load
from installer.realm import BOOTSTRAP_SECRET

MODEL = "SmolLM2-135M-Instruct"
SAMPLES = 2
MAX_TOKENS = 96
TURNS = 2


def wait_run(home: Home, run_id: int) -> runs.Run:
    while (run := runs.get(home, run_id)).state not in FINISHED:
        time.sleep(0.1)
    if run.state != "succeeded":
        raise SystemExit(f"run {run_id} {run.state}: {run.message}")
    return run


def pipelined(env: dict[str, str], home: Home, seed: int) -> float:
    """Seconds for one iteration through `appliance rl run` (the rl-worker, pipelined)."""
    started = time.monotonic()
    cli(env, "rl", "run", "--tasks", "starter", "--base", MODEL, "--samples", str(SAMPLES), "--rounds", "0",
        "--max-tokens", str(MAX_TOKENS), "--seed", str(seed))
    wait_run(home, runs.listing(home)[-1].id)
    return time.monotonic() - started


def sequential(settings: Settings, home: Home, scratch: Path, seed: int) -> tuple[float, float]:
    """Seconds to ask for every answer (same gateway, same concurrency), then to execute them all
    (same worker pool): generate-then-execute."""
    tasks = load("starter", "train", artifact_store(settings.artifacts, home), home)
    steps = [Step(task, sample, 0, first_messages(task)) for task in tasks for sample in range(SAMPLES)]
    generator = Generator(settings, home, MODEL)
    started = time.monotonic()
    with ThreadPoolExecutor(settings.rl.generation_concurrency) as threads:
        answers = list(threads.map(
            lambda step: generator.generate(step, MAX_TOKENS, 0.8, seed * 1_000_003 + step.sample * 101).text, steps))
    generated = time.monotonic() - started
    generator.close()
    store = RunStore(scratch / f"sequential-{seed}.sqlite")
    for step, answer in zip(steps, answers, strict=True):
        store.enqueue(step.key, extract_code(answer, step.task), step.task)
    pool = WorkerPool(store, home, settings.execution.workers or os.cpu_count() or 1)
    started = time.monotonic()
    while store.unfinished():
        pool.follow(store.depth())
        time.sleep(0.05)
    executed = time.monotonic() - started
    pool.stop()
    return generated, executed


def gate_figures(output: str) -> dict[str, Any]:
    """The gate's lines: 'NAME: pass@1 M% +/- S% over N seeds (a%, b%, c%)'."""
    found = re.findall(r"pass@1 ([\d.]+)% \+/- ([\d.]+)% over (\d+) seeds \(([^)]*)\)", output)
    base, tuned = ({"mean": float(m) / 100, "spread": float(s) / 100, "seeds": int(n),
                    "per_seed": [float(v.strip(" %")) / 100 for v in per.split(",")]} for m, s, n, per in found)
    return {"base": base, "adapter": tuned, "verdict": output.strip().splitlines()[-1]}


def measure_loop() -> dict[str, Any]:
    with own_appliance("apr-", SETTINGS_IN_ENV) as (home, env):
        root = home.root.parent  # scratch beside the home, removed with it
        cli(env, "up")
        settings = load_settings(home.settings_file, environ=env)
        cli(env, "rl", "tasks", "add-starter")
        times: dict[str, list[float]] = {"pipelined": [], "sequential": [], "generate": [], "execute": []}
        for turn in range(TURNS):
            generated, executed = sequential(settings, home, root, turn)
            times["generate"].append(generated)
            times["execute"].append(executed)
            times["sequential"].append(generated + executed)
            times["pipelined"].append(pipelined(env, home, turn))
        # One policy update: a run with corrections, its SFT set, an adapter, deployed, gated.
        cli(env, "rl", "run", "--tasks", "starter", "--base", MODEL, "--samples", "4", "--rounds", "1",
            "--max-tokens", str(MAX_TOKENS))
        update = wait_run(home, runs.listing(home)[-1].id)
        cli(env, "rl", "export", str(update.id), "--sft", "starter-sft")
        cli(env, "finetune", "run", "--data", "starter-sft", "--name", "starter-coder", "--base", MODEL,
            "--max-steps", "30", "--lr", "0.0005", "--batch-size", "4")
        cli(env, "token", "--user", "admin", "--password-stdin", stdin=secret(home, BOOTSTRAP_SECRET) + "\n")
        cli(env, "adapters", "deploy", "starter-coder", "--role", "user", "--role", "admin")
        gate = subprocess.run([APPLIANCE, "rl", "gate", "starter-coder", "--tasks", "starter", "--base", MODEL,
                               "--seeds", "3", "--max-tokens", str(MAX_TOKENS)], env=env, capture_output=True,
                              text=True, timeout=3600)
        progress = read_progress(home, update.id)
    median = {name: round(statistics.median(values), 1) for name, values in times.items()}
    return {
        "tasks": "starter (train split)", "samples": SAMPLES, "max_tokens": MAX_TOKENS, "turns": TURNS,
        "seconds": median, "all": {name: [round(v, 1) for v in values] for name, values in times.items()},
        "pipelined_speedup": round(median["sequential"] / median["pipelined"], 2),
        "update_run": progress.model_dump() if progress else None,
        "held_out_pass_at_1": gate_figures(gate.stdout),
    }


GRPO_STEPS = 3
GRPO_TASKS_PER_STEP = 2
GRPO_GROUP = 4
GRPO_TOKENS = 192
SETTINGS_IN_ENV = {"APPLIANCE_GATEWAY__PORT": "18480", "APPLIANCE_KEYCLOAK__PORT": "18490",
                   "APPLIANCE_KEYCLOAK__MANAGEMENT_PORT": "18491", "APPLIANCE_POOLS__MAIN__ENABLE_LORA": "true",
                   "APPLIANCE_RL__WORKER_POLL_S": "0.2"}
# The learning run: tasks the demo model solves some of the time (the starter set: about 9 in 10 of
# its tasks within a few tries, not every answer), so that a group's rewards differ.
LEARNING_STEPS = 8


def measure_grpo(tasks: str = "humaneval", step_count: int = GRPO_STEPS) -> dict[str, Any]:
    """Online GRPO on a task set's train split (HumanEval's; or the starter set's, which the demo
    model solves part of the time: a run that can learn): each step's time split into sampling
    (generation and execution, overlapping; each also added up over the answers) and update; then
    held-out pass@1 of the base model and the last policy version on the set's held-out fifth (`rl
    gate`: 3 seeds, 2 answers a task, the difference's 95 % interval from a bootstrap paired by task)."""
    policy = f"{tasks[:8]}-grpo"
    with own_appliance("apg-", SETTINGS_IN_ENV) as (home, env):
        cli(env, "up")
        cli(env, "rl", "tasks", "add-humaneval" if tasks == "humaneval" else "add-starter")
        cli(env, "rl", "run", "--tasks", tasks, "--base", MODEL, "--method", "grpo", "--policy", policy,
            "--steps", str(step_count), "--tasks-per-step", str(GRPO_TASKS_PER_STEP), "--samples", str(GRPO_GROUP),
            "--max-tokens", str(GRPO_TOKENS), "--learning-rate", "0.0005")
        started = time.monotonic()
        run = wait_run(home, runs.listing(home)[-1].id)
        run_s = time.monotonic() - started
        progress = read_progress(home, run.id)
        gate = subprocess.run([APPLIANCE, "rl", "gate", policy, "--tasks", tasks, "--base", MODEL,
                               "--seeds", "3", "--samples", "2", "--max-tokens", str(GRPO_TOKENS)], env=env,
                              capture_output=True, text=True, timeout=3 * 3600)
    assert progress is not None and progress.policy is not None
    steps = progress.policy.done
    interval = re.search(r"difference ([-+][\d.]+)% \(95% interval \[([-+][\d.]+)%, ([-+][\d.]+)%\]", gate.stdout)
    return {
        "tasks": f"{tasks} (train split)", "steps": step_count, "tasks_per_step": GRPO_TASKS_PER_STEP,
        "group": GRPO_GROUP, "max_tokens": GRPO_TOKENS, "run_s": round(run_s, 1),
        "per_step": [step.model_dump() for step in steps],
        "median_s": {name: round(statistics.median(getattr(step, name) for step in steps), 1)
                     for name in ("sample_s", "generate_s", "execute_s", "update_s")},
        "update_share": round(sum(s.update_s for s in steps) / sum(s.sample_s + s.update_s for s in steps), 2),
        "reward_by_step": [round(s.reward_mean, 3) for s in steps],
        "reward_spread_by_step": [round(s.reward_spread, 3) for s in steps],
        "pass_rate_by_step": [round(s.pass_rate, 3) for s in steps],
        "kl_by_step": [round(s.kl, 5) for s in steps],
        "held_out_pass_at_1": {**gate_figures(gate.stdout), "difference": None if interval is None else
                               dict(zip(("mean", "low", "high"), (float(v) / 100 for v in interval.groups()),
                                        strict=True))},
    }
