"""The agent gate: an adapter's episodes on a task set's held-out repository tasks against its base
model's, through the gateway. Each task gets the same number of trials (episodes, one sampling seed
each) from both; reported:
- pass@1: each task's share of passing episodes (submitted with every test passing), averaged;
- pass^k: the chance that k episodes of a task all pass (tau-bench's pass^k), from n trials with c
  passes as C(c, k) / C(n, k), averaged over tasks: how reliably it solves what it solves;
- each difference (adapter less base) with its 95 % interval from a bootstrap paired by task
  (finetune.rl.gate.paired);
- the regression check of the adapter's training (the shipped regression set, or the operator's),
  read from its version in the registry.
It passes when both intervals' lower ends are at least -max_drop and the regression check passed;
the scores and the verdict are recorded on the adapter's version. Every episode is kept
(appliance.rl.episodes) for `rl episodes show`."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from math import comb
from typing import Any, Literal

from appliance import adapters
from appliance.artifacts import ArtifactStore
from appliance.errors import Invalid
from appliance.home import Home
from appliance.rl import episodes
from appliance.rl.tasks import RepositoryTask, load_tasksets
from appliance.settings import Settings
from finetune.rl.agent import run_episode
from finetune.rl.environment import WorkspaceEnvironment
from finetune.rl.gate import Difference, paired
from finetune.rl.loop import Generator
from finetune.rl.tasks import load_repository

PASS_AT_1 = "held-out episodes pass@1"
FAILURE_PREFIX = "held-out episodes"


def pass_hat(passed: int, trials: int, k: int) -> float:
    """The chance that k trials drawn from `trials` (of which `passed` passed) all pass."""
    if not 1 <= k <= trials or not 0 <= passed <= trials:
        raise ValueError(f"pass^{k} of {passed} passes in {trials} trials")
    return comb(passed, k) / comb(trials, k)


@dataclass(frozen=True)
class Trials:
    """One model's episodes: for each task, whether each trial passed (trial i: seed i)."""

    model: str
    passed: dict[str, list[bool]]
    episodes: list[str]  # the kept episodes' ids

    def pass_at_1(self) -> dict[str, float]:
        return {task: statistics.fmean(found) for task, found in self.passed.items()}

    def pass_hat(self, k: int) -> dict[str, float]:
        return {task: pass_hat(sum(found), len(found), k) for task, found in self.passed.items()}

    def per_trial(self) -> list[float]:
        """Each trial's pass@1 over the tasks (the spread over seeds)."""
        count = len(next(iter(self.passed.values())))
        return [statistics.fmean(found[i] for found in self.passed.values()) for i in range(count)]


@dataclass(frozen=True)
class Outcome:
    base: Trials
    adapter: Trials
    k: int
    pass_at_1: Difference
    pass_hat_k: Difference
    regression: str  # the adapter's training's regression check, in words
    failures: list[str]

    def lines(self) -> list[str]:
        tasks, trials = len(self.base.passed), len(self.base.per_trial())
        means = {name: (statistics.fmean(t.pass_at_1().values()), statistics.fmean(t.pass_hat(self.k).values()))
                 for name, t in (("base", self.base), ("adapter", self.adapter))}
        return [f"{tasks} held-out tasks, {trials} episodes each a model",
                *(f"{name} ({trials_of.model}): pass@1 {means[name][0]:.1%}, pass^{self.k} {means[name][1]:.1%}"
                  for name, trials_of in (("base", self.base), ("adapter", self.adapter))),
                f"pass@1 {self.pass_at_1.line()}", f"pass^{self.k} {self.pass_hat_k.line()}", self.regression,
                f"gate: {'passed' if not self.failures else 'FAILED: ' + '; '.join(self.failures)}"]


def held_out_tasks(home: Home, name: str, artifacts: ArtifactStore) -> list[RepositoryTask]:
    """The held-out split of a set of repository tasks (its kind checked before it is read),
    refused when there is none to measure on."""
    found = load_tasksets(home).get(name)
    if found is not None and found.kind != "repository":
        raise Invalid(f"--tasks {name!r} holds programming tasks: the agent gate runs repository tasks",
                      hint="`appliance rl gate` measures programming tasks")
    loaded = load_repository(name, "held_out", artifacts, home)
    if not loaded:
        raise Invalid(f"task set {name!r} holds no held-out task to measure on",
                      hint="make it again with rl.held_out_fraction > 0 (and more than one task)")
    return loaded


def run_trials(tasks: list[RepositoryTask], model: str, trials: int, *, settings: Settings, home: Home,
               artifacts: ArtifactStore, task_set: str, temperature: float,
               tool_choice: Literal["auto", "required"], extra_body: dict[str, Any] | None,
               show: Callable[[str], None]) -> Trials:
    """`trials` episodes of each task by `model`, seeds 0 to trials-1, each kept."""
    passed: dict[str, list[bool]] = {task.id: [] for task in tasks}
    kept: list[str] = []
    generator = Generator(settings, home, model)
    try:
        for number, (task, seed) in enumerate(((t, s) for t in tasks for s in range(trials)), start=1):
            with WorkspaceEnvironment(task, settings.execution, settings.rl) as environment:
                episode = run_episode(task, generator, environment, settings.rl, temperature=temperature, seed=seed,
                                      tool_choice=tool_choice, extra_body=extra_body)
            kept.append(episodes.keep(episode.model_copy(update={"task_set": task_set}), artifacts, home).id)
            passed[task.id].append(episode.passed)
            show(f"{model}: episode {number}/{len(tasks) * trials} ({task.id}, seed {seed}): "
                 f"{'passed' if episode.passed else episode.ended}")
    finally:
        generator.close()
    return Trials(model, passed, kept)


def regression_check(home: Home, adapter: str, version: int) -> tuple[str, list[str]]:
    """What the adapter's training said of its regression set, and the failure, if any."""
    found = adapters.load(home).find(adapter, version)
    scores = found.metrics.eval_sets.get("regression")
    if scores is None:
        return (f"regression: {adapter} v{version} was trained without a regression set",
                [f"{adapter} v{version} has no regression score: train it with one (finetune.regression_set "
                 "shipped, or --regression FILE)"])
    said = (f"regression{' (the shipped set)' if scores.shipped else ''}: {scores.adapter:.0%} with the adapter, "
            f"{scores.base:.0%} without (from its training)")
    failed = [failure for failure in found.metrics.gate_failures if failure.startswith("regression score")]
    return said, failed


def judge(base: Trials, adapter: Trials, k: int, max_drop: float, regression: tuple[str, list[str]]) -> Outcome:
    """The differences, their intervals and the verdict."""
    if set(base.passed) != set(adapter.passed):
        raise Invalid("the base model and the adapter were measured on different tasks")
    at_1 = paired(base.pass_at_1(), adapter.pass_at_1())
    at_k = paired(base.pass_hat(k), adapter.pass_hat(k))
    failures = [f"{FAILURE_PREFIX} {name} {gain.line()}: its lower end must be at least {-max_drop or 0.0:+.0%}"
                for name, gain in (("pass@1", at_1), (f"pass^{k}", at_k)) if gain.low < -max_drop]
    return Outcome(base, adapter, k, at_1, at_k, regression[0], failures + regression[1])


def record(home: Home, adapter: str, version: int, outcome: Outcome) -> None:
    """The scores, intervals and verdict on the adapter's version in the registry."""
    k = outcome.k
    with adapters.updating(home) as registry:
        found = registry.find(adapter, version)
        found.metrics.eval_sets[PASS_AT_1] = adapters.Scores.over_seeds(
            outcome.base.per_trial(), outcome.adapter.per_trial()).model_copy(
            update={"difference_95": (outcome.pass_at_1.low, outcome.pass_at_1.high)})
        found.metrics.eval_sets[f"held-out episodes pass^{k}"] = adapters.Scores(
            base=statistics.fmean(outcome.base.pass_hat(k).values()),
            adapter=statistics.fmean(outcome.adapter.pass_hat(k).values()),
            difference_95=(outcome.pass_hat_k.low, outcome.pass_hat_k.high))
        found.metrics.gate_failures = [f for f in found.metrics.gate_failures if not f.startswith(FAILURE_PREFIX)]
        found.metrics.gate_failures += [f for f in outcome.failures if f.startswith(FAILURE_PREFIX)]
