"""The execution gate: an adapter's held-out pass@1 against its base model's, each measured over
several seeds (one RL run per seed and model: one answer per held-out task, no correction), with
mean and spread; recorded on the adapter's version in the registry."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from appliance import adapters
from appliance.artifacts import ArtifactStore
from appliance.errors import ApplianceError, Conflict, Invalid, NotFound
from appliance.home import Home
from appliance.jobs import FINISHED, JobState
from appliance.rl import runs
from appliance.rl.tasks import TaskSet, load_tasksets
from appliance.trajectories import read_run

SCORE = "held_out_pass@1"


@dataclass(frozen=True)
class PassAt1:
    model: str
    runs: list[int]
    per_seed: list[float]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.per_seed)

    @property
    def spread(self) -> float:
        """The sample standard deviation over seeds."""
        return statistics.stdev(self.per_seed) if len(self.per_seed) > 1 else 0.0

    def line(self) -> str:
        seeds = ", ".join(f"{score:.0%}" for score in self.per_seed)
        return f"{self.model}: pass@1 {self.mean:.1%} +/- {self.spread:.1%} over {len(self.per_seed)} seeds ({seeds})"


def pass_at_1(home: Home, artifacts: ArtifactStore, run_id: int, model: str) -> float:
    """Share of a run's tasks whose first answer passed (from its verified trajectories); every
    answer must come from `model` (the base's served name, or the adapter version's engine name)."""
    manifest, attempts = read_run(artifacts, home, run_id)
    if others := {a.model for a in attempts if a.model} - {model}:  # '' : the gateway refused the request
        raise Conflict(f"run {run_id} was answered by {sorted(others)}, not {model}: what the name serves changed "
                       "during the gate, or --base names an adapter", hint="run the gate once one version answers")
    first = {a.task: a.status == "passed" for a in attempts if a.round == 0 and a.sample == 0}
    return sum(first.values()) / len(manifest.tasks)


def measure(home: Home, artifacts: ArtifactStore, *, tasks: str, base: str, adapter: str | None, version: int | None,
            seeds: int, temperature: float, max_tokens: int, show: Callable[[str], None]) -> PassAt1:
    """Queue one held-out run per seed for the model (the rl-worker runs them) and wait for them (an
    interrupted gate cancels those not finished)."""
    digest = held_out_set(home, tasks).sha256
    specs = [runs.RunSpec(tasks=tasks, tasks_sha256=digest, split="held_out", base=base, adapter=adapter, samples=1,
                        rounds=0, temperature=temperature, max_tokens=max_tokens, seed=seed) for seed in range(seeds)]
    run_ids = [runs.submit(home, spec).id for spec in specs]
    name = adapter or base
    try:
        for run_id in run_ids:
            while (run := runs.get(home, run_id)).state not in FINISHED:
                show(f"{name}: run {run_id} {run.state}")
                time.sleep(1)
            if run.state != JobState.SUCCEEDED:
                raise ApplianceError(f"{name}: held-out run {run_id} {run.state}: {run.message}")
    except BaseException:
        for run_id in run_ids:
            if runs.get(home, run_id).state not in FINISHED:
                runs.cancel(home, run_id)
        raise
    model = base if adapter is None or version is None else adapters.engine_name(adapter, version)
    return PassAt1(name, run_ids, [pass_at_1(home, artifacts, run_id, model) for run_id in run_ids])


def held_out_set(home: Home, name: str) -> TaskSet:
    """The task set, if it holds held-out tasks to measure on."""
    found = load_tasksets(home).get(name)
    if found is None:
        raise NotFound(f"--tasks {name!r}: no such task set", hint="`appliance rl tasks list`")
    if found.held_out == 0:
        raise Invalid(f"task set {name!r} holds no held-out task to measure on",
                      hint="add it again with rl.held_out_fraction > 0 (and more than one task)")
    return found


def verdict(base: PassAt1, tuned: PassAt1, max_drop: float) -> list[str]:
    """Why the adapter fails the gate; empty: it passes."""
    if tuned.mean < base.mean - max_drop:
        return [f"held-out pass@1 {tuned.mean:.1%} vs base {base.mean:.1%}: may drop by {max_drop:.0%} at most"]
    return []


def record(home: Home, adapter: str, version: int, base: PassAt1, tuned: PassAt1, failures: list[str]) -> None:
    """The scores and the verdict on the adapter's version in the registry."""
    with adapters.updating(home) as registry:
        found = registry.find(adapter, version)
        found.metrics.eval_sets[SCORE] = adapters.Scores.over_seeds(base.per_seed, tuned.per_seed)
        found.metrics.gate_failures = [f for f in found.metrics.gate_failures if not f.startswith("held-out pass@1")]
        found.metrics.gate_failures += failures


def served_version(home: Home, adapter: str) -> int:
    """The version an adapter's name serves now (the one generating in the gate's runs)."""
    alias = adapters.load(home).aliases.get(adapter)
    if alias is None or alias.stable is None:
        raise Invalid(f"adapter {adapter!r} is not deployed: the gate generates through the gateway",
                      hint=f"deploy it first (for the roles that may try it): `appliance adapters deploy {adapter}`")
    if alias.canary is not None:
        raise Invalid(f"adapter {adapter!r} has a canary: the gate needs one version answering")
    return alias.stable
