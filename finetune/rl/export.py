"""From a run's trajectories to training data, each stored as a training dataset
(finetune.datasets: scanned, split, content-addressed) for `appliance finetune`:

- an SFT set: every passing attempt as a chat (the context it was given, corrections included, and
  its answer), for TRL's SFT trainer (`--method sft`);
- a preference set (TRL's format: prompt, chosen, rejected): for each task with a passing answer
  (first or corrected) and failing first answers, its first prompt with a passing answer chosen
  over each failing first answer, for TRL's DPO trainer (`--method dpo`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.artifacts import ArtifactStore, artifact_store
from appliance.datasets import register
from appliance.errors import Invalid
from appliance.home import Home
from appliance.rl.attempts import Attempt
from appliance.rl.exports import ExportAsk
from appliance.rl.runs import RunSpec
from appliance.settings import Settings
from appliance.trajectories import read_run
from finetune.datasets import Imported, Row, normalise, put, screen, split
from finetune.rl.tasks import load


def sft_rows(attempts: list[Attempt]) -> list[dict[str, Any]]:
    """Each passing attempt: its context and its answer (a corrected one teaches the correction)."""
    return [{"messages": [*attempt.messages, {"role": "assistant", "content": attempt.completion}]}
            for attempt in attempts if attempt.status == "passed"]


def dpo_rows(attempts: list[Attempt]) -> list[dict[str, Any]]:
    """Per task, each failing first answer paired with a passing answer, first or corrected (cycled)."""
    by_task: dict[str, list[Attempt]] = defaultdict(list)
    for attempt in attempts:
        by_task[attempt.task].append(attempt)
    rows = []
    for task in sorted(by_task):
        group = by_task[task]
        chosen = [a for a in group if a.status == "passed"]
        rejected = [a for a in group if a.status != "passed" and a.round == 0]
        if not chosen:
            continue
        prompt = next(a.messages for a in group if a.round == 0)
        for index, bad in enumerate(rejected):
            good = chosen[index % len(chosen)]
            if good.completion == bad.completion:  # the same answer passed once and failed once: no preference
                continue
            rows.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": good.completion}],
                         "rejected": [{"role": "assistant", "content": bad.completion}]})
    return rows


@dataclass(frozen=True)
class Prepared:
    """A set ready to store: its rows scanned (and redacted where settings say) and split."""

    train: list[dict[str, Any]]
    evaluation: list[dict[str, Any]]
    sensitive: dict[str, int]


def prepare_set(run_id: int, rows: list[dict[str, Any]], what: str, settings: Settings) -> Prepared:
    """The rows as a dataset's (finetune.datasets.normalise: those a dataset would refuse, an empty
    answer say, left out), scanned for sensitive data and split; Invalid if none is left, and the
    scan's refusal under `compliance.training_data = block`."""
    kept: list[Row] = []
    for row in rows:
        try:
            kept.append(Row(len(kept) + 1, normalise(row)))
        except ValueError:
            continue
    if not kept:
        raise Invalid(f"run {run_id} has no {what}")
    scanned, sensitive = screen(kept, settings.compliance)
    train, evaluation = split(scanned, settings.finetune.eval_fraction)
    return Prepared(train, evaluation, sensitive)


def put_set(name: str, run_id: int, prepared: Prepared, settings: Settings, artifacts: ArtifactStore) -> Imported:
    """Put a prepared set's files in the store, content-addressed (named by `register`)."""
    return put(name, Path(f"rl-run-{run_id}.jsonl"), prepared.train, prepared.evaluation, prepared.sensitive,
               settings.compliance.training_data, artifacts)


@dataclass
class Exported:
    left_out: int  # attempts at the task set's held-out tasks
    stored: list[tuple[str, Imported]]

    def lines(self) -> list[str]:
        told = [f"left out: {self.left_out} attempts at the task set's held-out tasks"] if self.left_out else []
        return told + [f"{label}: dataset {done.name}, {done.rows} rows ({done.train} train, {done.eval} eval), "
                       f"sha256 {done.digest}" for label, done in self.stored]


def export_run(run_id: int, ask: ExportAsk, settings: Settings, home: Home) -> Exported:
    """The datasets `ask` names, made from a run's verified trajectories (`appliance rl export`, and the
    rl-worker for the admin API). Attempts at held-out tasks are left out: training on them would
    leave the gate measuring on training data. Both sets are built, scanned and put in the store
    before either is named: all or nothing (files put by an attempt that failed are unnamed, and put
    again, the same bytes, by the next)."""
    artifacts = artifact_store(settings.artifacts, home)
    manifest, attempts = read_run(artifacts, home, run_id)
    spec = RunSpec.model_validate(manifest.spec)
    held_out = {task.id for task in load(spec.tasks, "held_out", artifacts, home, spec.tasks_sha256)}
    kept = [attempt for attempt in attempts if attempt.task not in held_out]
    chosen = [(label, name, prepare_set(run_id, rows, what, settings)) for label, name, rows, what in (
        ("SFT set", ask.sft, sft_rows(kept), "passing attempt at a training task"),
        ("preference set", ask.dpo, dpo_rows(kept), "training task with a passing answer and a failing first one"))
        if name is not None]
    stored = [(label, put_set(name, run_id, prepared, settings, artifacts)) for label, name, prepared in chosen]
    register(home, {done.name: done.digest for _, done in stored})
    return Exported(len(attempts) - len(kept), stored)
