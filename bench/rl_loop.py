"""The loop of issue 20, measured piece by piece as it is built. So far: the execution sandbox.

Sandbox executions per second with full isolation (finetune.rl.execute: bubblewrap namespaces,
the dedicated user, limits, the harness running each test in a child) against a bare
`subprocess.run` of the same program and tests in one Python process, the same programs, taking
turns, in this invocation. (To come with the loop itself: pipelined vs sequential iterations,
held-out pass@1 before and after a policy update.)

Run: .venv/bin/python bench/rl_loop.py [--executions N]   (as root, the sandbox's user exists)
Writes bench/results/rl_loop.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from appliance.settings import ExecutionSettings
from finetune.rl.execute import execute

RESULTS = Path(__file__).parent / "results" / "rl_loop.json"
ROUNDS = 3


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


def sandboxed(program: str, tests: str, settings: ExecutionSettings) -> bool:
    return execute(program, "python", settings, tests=tests).status == "passed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executions", type=int, default=40)
    args = parser.parse_args()
    settings = ExecutionSettings()
    work = programs(args.executions)
    rates: dict[str, list[float]] = {"bare": [], "sandbox": []}
    agree = True
    for _ in range(ROUNDS):
        for name in ("bare", "sandbox"):
            started = time.monotonic()
            verdicts = [bare(p, t) if name == "bare" else sandboxed(p, t, settings) for p, t in work]
            rates[name].append(len(work) / (time.monotonic() - started))
            agree = agree and verdicts == [i % 4 != 3 for i in range(len(work))]
    result = {
        "executions_per_round": len(work), "rounds": ROUNDS, "verdicts_agree": agree,
        "bare_per_s": round(statistics.median(rates["bare"]), 1),
        "sandbox_per_s": round(statistics.median(rates["sandbox"]), 1),
        "ratio": round(statistics.median(rates["sandbox"]) / statistics.median(rates["bare"]), 2),
        "all": {name: [round(r, 1) for r in values] for name, values in rates.items()},
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
