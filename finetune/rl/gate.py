"""The execution gate: an adapter's held-out pass@1 against its base model's, each measured over
several seeds (one RL run per seed and model: a few answers per held-out task, no correction),
with mean and spread, and the difference's 95 % interval from a bootstrap paired by task; it passes
only when the interval's lower end clears the margin. Recorded on the adapter's version in the
registry."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from appliance import adapters
from appliance.artifacts import ArtifactStore, artifact_store
from appliance.changes import note_target
from appliance.errors import ApplianceError, Conflict, Invalid, NotFound
from appliance.home import Home
from appliance.jobs import FINISHED, JobState
from appliance.rl import runs
from appliance.rl.tasks import TaskSet, load_tasksets
from appliance.settings import Settings, load_settings
from appliance.trajectories import read_run

SCORE = "held_out_pass@1"


BOOTSTRAP_RESAMPLES = 10_000


@dataclass(frozen=True)
class PassAt1:
    model: str
    runs: list[int]
    per_task: list[dict[str, float]]  # a seed's run: each task's share of first answers that passed

    @property
    def per_seed(self) -> list[float]:
        return [statistics.fmean(tasks.values()) for tasks in self.per_task]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.per_seed)

    def task_means(self) -> dict[str, float]:
        """Each task's pass rate over every seed."""
        return {task: statistics.fmean(seed[task] for seed in self.per_task) for task in self.per_task[0]}

    @property
    def spread(self) -> float:
        """The sample standard deviation over seeds."""
        return statistics.stdev(self.per_seed) if len(self.per_seed) > 1 else 0.0

    def line(self) -> str:
        seeds = ", ".join(f"{score:.0%}" for score in self.per_seed)
        return f"{self.model}: pass@1 {self.mean:.1%} +/- {self.spread:.1%} over {len(self.per_seed)} seeds ({seeds})"


def pass_at_1(home: Home, artifacts: ArtifactStore, run_id: int, model: str) -> dict[str, float]:
    """Each of a run's tasks' share of first answers (one a sample, before any correction) that
    passed (from its verified trajectories; a task with no answer counts 0); every answer must come
    from `model` (the base's served name, or the adapter version's engine name)."""
    manifest, attempts = read_run(artifacts, home, run_id)
    if others := {a.model for a in attempts if a.model} - {model}:  # '' : the gateway refused the request
        raise Conflict(f"run {run_id} was answered by {sorted(others)}, not {model}: what the name serves changed "
                       "during the gate, or --base names an adapter", hint="run the gate once one version answers")
    passed: dict[str, list[bool]] = {task: [] for task in manifest.tasks}
    for attempt in attempts:
        if attempt.round == 0 and attempt.task in passed:
            passed[attempt.task].append(attempt.status == "passed")
    return {task: statistics.fmean(found) if found else 0.0 for task, found in passed.items()}


@dataclass(frozen=True)
class Difference:
    """The adapter's score less the base model's, and its 95 % interval (bootstrap over tasks)."""

    mean: float
    low: float
    high: float
    tasks: int

    def line(self) -> str:
        return (f"difference {self.mean:+.1%} (95% interval [{self.low:+.1%}, {self.high:+.1%}], paired "
                f"bootstrap over {self.tasks} tasks)")


def difference(base: PassAt1, tuned: PassAt1, resamples: int = BOOTSTRAP_RESAMPLES) -> Difference:
    """Each task's pass rate with the adapter less without (over every seed and sample), paired."""
    return paired(base.task_means(), tuned.task_means(), resamples)


def paired(before: dict[str, float], after: dict[str, float], resamples: int = BOOTSTRAP_RESAMPLES) -> Difference:
    """Paired by task: each task's score after less before, resampled with replacement `resamples`
    times (a fixed seed: the same scores give the same interval); the 2.5th and 97.5th percentiles
    of the resampled means."""
    if set(before) != set(after) or not before:
        raise Conflict("the base model and the adapter were measured on different tasks")
    gains = [after[task] - before[task] for task in sorted(before)]
    draw = random.Random(0)
    means = sorted(statistics.fmean(draw.choices(gains, k=len(gains))) for _ in range(resamples))
    return Difference(mean=statistics.fmean(gains), low=means[int(0.025 * resamples)],
                      high=means[min(resamples - 1, int(0.975 * resamples))], tasks=len(gains))


def measure(home: Home, artifacts: ArtifactStore, *, tasks: str, base: str, adapter: str | None, version: int | None,
            seeds: int, samples: int, temperature: float, max_tokens: int, show: Callable[[str], None]) -> PassAt1:
    """Queue one held-out run per seed for the model, `samples` answers a task (the rl-worker runs
    them), and wait for them (an interrupted gate cancels those not finished)."""
    digest = held_out_set(home, tasks).sha256
    specs = [runs.RunSpec(tasks=tasks, tasks_sha256=digest, split="held_out", base=base, adapter=adapter,
                          samples=samples, rounds=0, temperature=temperature, max_tokens=max_tokens, seed=seed)
             for seed in range(seeds)]
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


def verdict(gain: Difference, max_drop: float) -> list[str]:
    """Why the adapter fails the gate; empty: it passes (the difference's interval's lower end at
    least -max_drop: with 95 % confidence it is no worse than that)."""
    if gain.low < -max_drop:
        return [f"held-out pass@1 {gain.line()}: its lower end must be at least {-max_drop or 0.0:+.0%}"]
    return []


def record(home: Home, adapter: str, version: int, base: PassAt1, tuned: PassAt1, gain: Difference,
           failures: list[str]) -> None:
    """The scores, the difference's interval and the verdict on the adapter's version in the registry."""
    with adapters.updating(home) as registry:
        found = registry.find(adapter, version)
        found.metrics.eval_sets[SCORE] = adapters.Scores.over_seeds(base.per_seed, tuned.per_seed).model_copy(
            update={"difference_95": (gain.low, gain.high)})
        found.metrics.gate_failures = [f for f in found.metrics.gate_failures if not f.startswith("held-out pass@1")]
        found.metrics.gate_failures += failures


def gated(adapter: str) -> tuple[Home, Settings, ArtifactStore, int]:
    """For a gate of `adapter`: the appliance's home, settings and artifact store, and the version
    the adapter serves (each noted as the change's target)."""
    home = Home.from_env()
    settings = load_settings(home.settings_file)
    note_target("adapter", adapter)
    version = served_version(home, adapter)
    note_target("adapter", adapter, version=version)
    return home, settings, artifact_store(settings.artifacts, home), version


def served_version(home: Home, adapter: str) -> int:
    """The version an adapter's name serves now (the one generating in the gate's runs)."""
    alias = adapters.load(home).aliases.get(adapter)
    if alias is None or alias.stable is None:
        raise Invalid(f"adapter {adapter!r} is not deployed: the gate generates through the gateway",
                      hint=f"deploy it first (for the roles that may try it): `appliance adapters deploy {adapter}`")
    if alias.canary is not None:
        raise Invalid(f"adapter {adapter!r} has a canary: the gate needs one version answering")
    return alias.stable
