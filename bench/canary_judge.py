"""What weighing canary outcomes by user costs: one window judged (appliance.canary.judge, run
under the gateway's canary lock once a window) with N users reporting on each version, against
the same window's outcomes pooled the way they were before (every report counted alike: successes
over reports, one comparison), taking turns, ROUNDS times per size.

    .venv/bin/python -m bench.canary_judge

Writes bench/results/canary_judge.json.
"""

from __future__ import annotations

import functools
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from appliance.canary import CanaryAnalysis, WindowFigures, judge

RESULTS = Path(__file__).parent / "results" / "canary_judge.json"
SIZES = (100, 1_000, 10_000)
ROUNDS = 15
POLICY = CanaryAnalysis()


def window(users: int, success: float, seed: int) -> WindowFigures:
    """A version's window: 20 answers of the gateway's own, and `users` users reporting 1 to 5
    times each, with satisfaction."""
    rng = random.Random(seed)
    found = WindowFigures()
    for n in range(max(POLICY.min_requests, 20)):
        found.add(f"client{n}", error=False, latency_s=rng.uniform(0.5, 1.5), ttft_s=None, cap=POLICY.max_per_user)
    for user in range(users):
        for _ in range(rng.randint(1, 5)):
            found.report(f"u{user}", rng.random() < success, rng.randint(1, 5), POLICY.max_per_user)
    return found


def pooled(stable: WindowFigures, canary: WindowFigures) -> bool:
    """The rule before: every report alike, the canary's pooled success rate against the stable's."""
    def rate(figures: WindowFigures) -> float:
        successes = sum(mine.successes for mine in figures.reporters.values())
        reports = sum(mine.successes + mine.failures for mine in figures.reporters.values())
        return successes / reports
    return rate(stable) - rate(canary) > POLICY.max_success_drop


def timed(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def main() -> None:
    figures: dict[str, dict[str, float]] = {}
    for users in SIZES:
        stable, canary = window(users, 0.9, 1), window(users, 0.85, 2)
        times: dict[str, list[float]] = {"by_user": [], "pooled": []}
        for _ in range(ROUNDS):
            times["pooled"].append(timed(functools.partial(pooled, stable, canary)))
            times["by_user"].append(timed(functools.partial(judge, POLICY, stable, canary)))
        medians = {path: statistics.median(values) * 1000 for path, values in times.items()}
        figures[str(users)] = {"by_user_ms": round(medians["by_user"], 3), "pooled_ms": round(medians["pooled"], 3),
                               "ratio": round(medians["by_user"] / medians["pooled"], 1)}
        print(f"{users:>6} users a version: judged by user {medians['by_user']:.3f} ms, pooled "
              f"{medians['pooled']:.3f} ms ({medians['by_user'] / medians['pooled']:.1f} x)")
    RESULTS.write_text(json.dumps({"rounds": ROUNDS, "sizes": figures}, indent=2) + "\n")


if __name__ == "__main__":
    main()
