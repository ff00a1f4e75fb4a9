"""Agent episodes and repository tasks, measured.

- make: `rl tasks make` on mpmath (as the appliance's wheels install it): tasks made per hour, the
  share of bugs tried that a test caught (kept), and the time spent validating in the sandbox.
- tools: one episode's tool calls without a model (a solution: list, read, search, write the fix,
  run the tests, submit) in the episode's sandbox (finetune.rl.environment), against the same work
  done bare (the files in a temporary directory, each test in a `subprocess.run` of the same
  interpreter), taking turns, ROUNDS each; the sandbox's time split into its start (the cell and
  the task's files), the calls, and the end (the tests restored and run, the workspace's digest).
- episodes (--episodes N; starts an appliance of its own: Keycloak, the demo model's engine, the
  gateway): N episodes through the gateway as the RL identity on the same task, the demo model
  made to write calls by structured output, three answers each: episodes per hour and the time
  split (generation, tool calls, sandbox start, the end).

- gate (--gate N; an appliance of its own): N tasks made from mpmath, a fifth held out; an adapter
  taught the tool-call format (bench.tool_format's generated episodes, LoRA, trained with the
  shipped regression set) against the base model, `--trials` episodes a held-out task each
  through the gateway (`rl episodes gate`): pass@1, pass^k, their paired intervals, the
  adapter's regression check.

Run: .venv/bin/python -m bench.agentic [--make N] [--episodes N] [--gate N [--trials K]]
     (as root, after ./bootstrap.sh --no-start)
Writes bench/results/agentic.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from appliance import adapters
from appliance.rl.episodes import Episode
from appliance.secrets import secret
from appliance.settings import ExecutionSettings, RlSettings
from bench.own_appliance import APPLIANCE, cli, own_appliance
from finetune.rl.environment import Call, WorkspaceEnvironment
from finetune.rl.task_maker import Made, make, source_of
from tests.support.ports import free_port
from tests.support.repository_tasks import CALC_TASK, CALLS, FIXED

RESULTS = Path(__file__).parent / "results" / "agentic.json"
ROUNDS = 5
MODEL = "SmolLM2-135M-Instruct"
TASK = CALC_TASK
SOLUTION = [Call("1", "list_files", "{}"), Call("2", "read_file", '{"path": "calc/__init__.py"}'),
            Call("3", "search", '{"text": "def add"}'), Call("4", "run_tests", "{}"),
            Call("5", "write_file", json.dumps({"path": "calc/__init__.py", "content": FIXED})),
            Call("6", "run_tests", "{}"), Call("7", "submit", "{}")]


def made_tasks(limit: int) -> dict[str, Any]:
    def said(made: Made) -> None:
        print(f"  make: {len(made.tasks)} kept of {made.tried} tried", file=sys.stderr, flush=True)

    made = make(source_of("mpmath"), limit, 0, ExecutionSettings(), RlSettings(), said)
    return {"source": "mpmath", "kept": len(made.tasks), "tried": made.tried, "equivalent": made.equivalent,
            "unsound": made.unsound, "seconds": made.seconds, "validation_s": round(made.validation_s, 1),
            "tasks_per_hour": round(len(made.tasks) / made.seconds * 3600),
            "share_kept": round(len(made.tasks) / made.tried, 3) if made.tried else None}


def sandboxed() -> dict[str, float]:
    with WorkspaceEnvironment(TASK, ExecutionSettings(), RlSettings()) as env:
        started = time.monotonic()
        env.reset()
        reset = time.monotonic()
        result = env.step(SOLUTION[:-1], 0)
        called = time.monotonic()
        end = env.step(SOLUTION[-1:], 0)
        ended = time.monotonic()
    assert not result.done and end.reward == 1.0, (result, end)
    return {"start_s": reset - started, "calls_s": called - reset, "end_s": ended - called, "total_s": ended - started}


def bare() -> dict[str, float]:
    """The same work without the sandbox: files in a directory, tests in subprocesses."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as work:
        root = Path(work)
        for path, text in TASK.files.items():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(text)
        reset = time.monotonic()
        sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))
        (root / "calc/__init__.py").read_text()
        [line for p in root.rglob("*.py") for line in p.read_text().splitlines() if "def add" in line]
        tests = ["test_add", "test_zero"]

        def run_tests() -> int:
            runner = "import sys; sys.path.insert(0, '.'); import tests.test_calc as t; getattr(t, sys.argv[1])()"
            return sum(subprocess.run([sys.executable, "-I", "-S", "-B", "-c", runner, name], cwd=root,
                                      capture_output=True).returncode == 0 for name in tests)
        run_tests()
        (root / "calc/__init__.py").write_text(FIXED)
        run_tests()
        called = time.monotonic()
        assert run_tests() == 2
        ended = time.monotonic()
    return {"start_s": reset - started, "calls_s": called - reset, "end_s": ended - called, "total_s": ended - started}


def tools() -> dict[str, Any]:
    runs: dict[str, list[dict[str, float]]] = {"sandbox": [], "bare": []}
    for _ in range(ROUNDS):
        runs["sandbox"].append(sandboxed())
        runs["bare"].append(bare())
    median = {side: {k: round(statistics.median(r[k] for r in found), 4) for k in found[0]}
              for side, found in runs.items()}
    return {"rounds": ROUNDS, "calls": len(SOLUTION), "median": median,
            "sandbox_over_bare": round(median["sandbox"]["total_s"] / median["bare"]["total_s"], 2)}


def episodes(count: int) -> dict[str, Any]:
    settings = {"APPLIANCE_GATEWAY__PORT": str(free_port()), "APPLIANCE_KEYCLOAK__PORT": str(free_port()),
                "APPLIANCE_KEYCLOAK__MANAGEMENT_PORT": str(free_port()), "APPLIANCE_POOLS__MAIN__TOOL_PARSER": "hermes",
                "APPLIANCE_RL__EPISODE_STEPS": "3", "APPLIANCE_RL__EPISODE_ANSWER_TOKENS": "96"}
    with own_appliance("agentic-", settings) as (home, env):
        cli(env, "up", timeout=1800)
        task = home.root / "task.json"
        task.write_text(TASK.model_dump_json())
        done: list[Episode] = []
        started = time.monotonic()
        for number in range(count):
            out = home.root / f"episode-{number}.json"
            subprocess.run([str(Path(sys.executable).with_name("appliance")), "rl", "episodes", "run",
                            "--task", str(task), "--model", MODEL, "--out", str(out), "--seed", str(number),
                            "--extra-body", json.dumps({"structured_outputs": {"regex": CALLS}})],
                           env=env, capture_output=True, timeout=900)
            done.append(Episode.model_validate_json(out.read_text()))
        seconds = time.monotonic() - started
    generation = sum(t.generation_s for e in done for t in e.turns)
    calls = sum(s.seconds for e in done for t in e.turns for s in t.tools)
    start = sum(e.reset_s for e in done)
    inside = sum(e.seconds for e in done)
    return {"episodes": count, "seconds": round(seconds, 1), "episodes_per_hour": round(count / seconds * 3600),
            "answers": sum(len(e.turns) for e in done), "tool_calls": sum(e.tool_calls for e in done),
            "ended": [e.ended for e in done], "rewards": [e.reward for e in done],
            "split_s": {"generation": round(generation, 1), "tool_calls": round(calls, 1),
                        "sandbox_start": round(start, 1),
                        "end_and_driver": round(inside - generation - calls - start, 1),
                        "command_start": round(seconds - inside, 1)}}


def gate(limit: int, trials: int, rows: int, steps: int, lr: float) -> dict[str, Any]:
    """The agent gate on held-out repository tasks: `limit` tasks made from mpmath (a fifth held
    out), the base model against an adapter taught the tool-call format (LoRA on `rows` generated
    episodes, bench.tool_format's, `steps` steps; trained with the shipped regression set), each
    `trials` episodes a held-out task through the gateway, sampled, the model free to call tools
    or not (no structured output): pass@1, pass^k, their paired intervals, the regression check."""
    from bench.tool_format import episodes as tool_rows
    from installer.realm import BOOTSTRAP_SECRET

    settings = {"APPLIANCE_GATEWAY__PORT": str(free_port()), "APPLIANCE_KEYCLOAK__PORT": str(free_port()),
                "APPLIANCE_KEYCLOAK__MANAGEMENT_PORT": str(free_port()), "APPLIANCE_POOLS__MAIN__TOOL_PARSER": "hermes",
                "APPLIANCE_POOLS__MAIN__ENABLE_LORA": "true", "APPLIANCE_RL__EPISODE_STEPS": "4",
                "APPLIANCE_RL__EPISODE_ANSWER_TOKENS": "128"}
    with own_appliance("agate-", settings) as (home, env):
        cli(env, "up", timeout=1800)
        started = time.monotonic()
        cli(env, "rl", "tasks", "make", "--from", "mpmath", "--name", "mpmath-bugs", "--limit", str(limit),
            timeout=3600)
        made_s = time.monotonic() - started
        data = home.root / "tool-rows.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in tool_rows(rows)))
        cli(env, "data", "add", str(data), "--name", "tool-format", "--model", MODEL)
        started = time.monotonic()
        trained = subprocess.run([APPLIANCE, "finetune", "run", "--data", "tool-format", "--base", MODEL,
                                  "--name", "agent", "--max-steps", str(steps), "--batch-size", "2", "--lr", str(lr),
                                  "--max-length", "1024"], env=env, capture_output=True, text=True, timeout=7200)
        train_s = time.monotonic() - started
        print(trained.stdout[-1500:], trained.stderr[-1500:], file=sys.stderr, flush=True)
        version = adapters.load(home).find("agent", 1).metrics
        regression = version.eval_sets["regression"]
        training = {"rows": rows, "steps": steps, "lr": lr, "seconds": round(train_s),
                    "held_out_loss": [round(version.base_eval_loss, 4), round(version.adapter_eval_loss, 4)],
                    "regression_shipped": {"base": round(regression.base, 3), "adapter": round(regression.adapter, 3),
                                           "base_per_seed": regression.base_per_seed,
                                           "adapter_per_seed": regression.adapter_per_seed},
                    "gate_failures": version.gate_failures}
        if trained.returncode != 0:  # never served: the agent gate has nothing to measure
            return {"tasks_made": limit, "made_s": round(made_s), "training": training,
                    "agent_gate": "not run: the adapter failed its training gate"}
        cli(env, "token", "--user", "admin", "--password-stdin", stdin=secret(home, BOOTSTRAP_SECRET) + "\n")
        cli(env, "adapters", "deploy", "agent", "--role", "user", "--role", "admin", timeout=900)
        started = time.monotonic()
        gated = subprocess.run([APPLIANCE, "rl", "episodes", "gate", "agent", "--tasks", "mpmath-bugs", "--base",
                                MODEL, "--trials", str(trials), "--json"], env=env, capture_output=True, text=True,
                               timeout=4 * 3600)
        gate_s = time.monotonic() - started
        assert gated.returncode in (0, 1), gated.stdout + gated.stderr
        said = json.loads(gated.stdout)
        kept = {e["id"]: e for e in json.loads(cli(env, "rl", "episodes", "list", "--json"))}
    ended = {side: dict(Counter(kept[i]["ended"] for i in said[f"{side}_episodes"])) for side in ("base", "adapter")}
    return {"tasks_made": limit, "made_s": round(made_s), "held_out": len(said["base"]), "trials": trials,
            "k": said["k"], "training": training,
            "pass_at_1": said["pass_at_1"], "pass_hat_k": said["pass_hat_k"], "regression": said["regression"],
            "passed": {"base": said["base"], "adapter": said["adapter_passed"]}, "ended": ended,
            "failures": said["failures"], "gate_s": round(gate_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--make", type=int, default=20, help="tasks to make from mpmath (0: none)")
    parser.add_argument("--episodes", type=int, default=0, help="episodes through an appliance of its own")
    parser.add_argument("--gate", type=int, default=0, help="tasks to make for the agent gate on an appliance of "
                                                            "its own (0: no gate)")
    parser.add_argument("--trials", type=int, default=4, help="the gate's episodes per held-out task and model")
    parser.add_argument("--gate-steps", type=int, default=60, help="the adapter's training steps")
    parser.add_argument("--gate-lr", type=float, default=0.001, help="the adapter's learning rate")
    args = parser.parse_args()
    # A section not run this time keeps its last figures.
    found: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {"bench": "agentic"}
    found["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    found["tools"] = tools()
    print(json.dumps(found["tools"]), flush=True)
    if args.make:
        found["make"] = made_tasks(args.make)
        print(json.dumps(found["make"]), flush=True)
    if args.episodes:
        found["episodes"] = episodes(args.episodes)
        print(json.dumps(found["episodes"]), flush=True)
    if args.gate:
        found["gate"] = gate(args.gate, args.trials, rows=300, steps=args.gate_steps, lr=args.gate_lr)
        print(json.dumps(found["gate"]), flush=True)
    RESULTS.write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    main()
