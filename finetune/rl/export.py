"""From a run's trajectories to training data:

- an SFT set: every passing attempt as a chat (the context it was given, corrections included, and
  its answer), stored as a training dataset (finetune.datasets: scanned, split, content-addressed),
  so `appliance finetune submit --data NAME` trains on it with TRL's SFT trainer;
- a preference set (TRL's DPO format: prompt, chosen, rejected): for each task with passing and
  failing attempts, its first prompt with a passing answer chosen over a failing one, stored
  content-addressed in the artifact store.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from appliance.artifacts import ArtifactStore
from appliance.errors import Invalid
from appliance.home import Home
from appliance.rl import Attempt
from appliance.settings import Settings
from finetune.datasets import Imported, Row, scan, split, store
from finetune.pii import Scanner

PREFERENCES = "preferences/"


def sft_rows(attempts: list[Attempt]) -> list[dict[str, Any]]:
    """Each passing attempt: its context and its answer (a corrected one teaches the correction)."""
    return [{"messages": [*attempt.messages, {"role": "assistant", "content": attempt.completion}]}
            for attempt in attempts if attempt.status == "passed"]


def dpo_rows(attempts: list[Attempt]) -> list[dict[str, Any]]:
    """Per task, each failing answer to the first prompt paired with a passing answer (cycled)."""
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
            rows.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": good.completion}],
                         "rejected": [{"role": "assistant", "content": bad.completion}],
                         "task": task})
    return rows


def store_sft(name: str, run_id: int, attempts: list[Attempt], settings: Settings, artifacts: ArtifactStore,
              home: Home) -> Imported:
    rows = sft_rows(attempts)
    if not rows:
        raise Invalid(f"run {run_id} has no passing attempt: no SFT set to build")
    options = settings.finetune
    scanned, sensitive = scan([Row(number, row) for number, row in enumerate(rows, start=1)],
                              Scanner(options.sensitive_patterns), options.sensitive_data)
    train, evaluation = split(scanned, options.eval_fraction)
    return store(name, Path(f"rl-run-{run_id}-sft.jsonl"), train, evaluation, sensitive, options.sensitive_data,
                 artifacts, home)


def store_dpo(run_id: int, attempts: list[Attempt], artifacts: ArtifactStore) -> tuple[str, int]:
    """(its key in the artifact store, its rows)."""
    rows = dpo_rows(attempts)
    if not rows:
        raise Invalid(f"run {run_id} has no task with both a passing and a failing first answer: no preference set")
    data = b"".join(json.dumps(row, ensure_ascii=False, sort_keys=True).encode() + b"\n" for row in rows)
    key = f"{PREFERENCES}{hashlib.sha256(data).hexdigest()}.jsonl"
    artifacts.put(key, data, retain_days=0)
    return key, len(rows)
