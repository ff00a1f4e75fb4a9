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
from pathlib import Path
from typing import Any

from appliance.artifacts import ArtifactStore
from appliance.errors import Invalid
from appliance.home import Home
from appliance.rl import Attempt
from appliance.settings import Settings
from finetune.datasets import Imported, Row, normalise, scan, split, store
from finetune.pii import Scanner


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


def training_rows(run_id: int, rows: list[dict[str, Any]], what: str) -> list[Row]:
    """The rows as a dataset's (finetune.datasets.normalise), those a dataset would refuse left out
    (an empty answer, say); Invalid if none is left."""
    kept: list[Row] = []
    for row in rows:
        try:
            kept.append(Row(len(kept) + 1, normalise(row)))
        except ValueError:
            continue
    if not kept:
        raise Invalid(f"run {run_id} has no {what}")
    return kept


def store_set(name: str, run_id: int, rows: list[Row], settings: Settings, artifacts: ArtifactStore,
              home: Home) -> Imported:
    """Store rows (SFT or preference) as a training dataset: scanned, split, content-addressed."""
    options = settings.finetune
    scanned, sensitive = scan(rows, Scanner(options.sensitive_patterns), options.sensitive_data)
    train, evaluation = split(scanned, options.eval_fraction)
    return store(name, Path(f"rl-run-{run_id}.jsonl"), train, evaluation, sensitive, options.sensitive_data,
                 artifacts, home)
