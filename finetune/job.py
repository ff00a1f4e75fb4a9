"""`python -m finetune.job DIR`: train the job laid out in DIR by finetune.runner (job.json,
train.jsonl, eval.jsonl). The runner starts it in a sandbox with no network (under torchrun
when several processes train); it reports progress in DIR/progress.json and leaves
DIR/result.json and DIR/adapter. The spec's strategy picks the trainer: fsdp the sharded one
(finetune.sharded), ddp and single TRL's (finetune.train). Exit status: 0 trained, 1 failed
(the reason on stderr)."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from appliance.errors import ApplianceError
from appliance.jobs import HEARTBEAT_FILE, write_progress
from finetune.sharded import train_sharded
from finetune.train import TrainingSpec, train_adapter

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """Be killed when the process that started this one dies (the sandbox's init, which dies with
    the worker; or torchrun's agent): a killed worker must not leave a trainer running. (The restarted
    worker also ends the old trainer's process group before it resumes the job.)"""
    parent = os.getppid()  # in the sandbox's PID namespace that is its init, pid 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the line above
        sys.exit(1)


def main(directory: Path) -> int:
    die_with_parent()
    spec = TrainingSpec.model_validate_json((directory / "job.json").read_bytes())
    train, evaluation = ([json.loads(line) for line in (directory / f"{split}.jsonl").read_text().splitlines()]
                         for split in ("train", "eval"))
    common: dict[str, Any] = dict(
        on_progress=lambda progress: write_progress(directory, progress), eval_sets=spec.eval_sets,
        on_beat=(directory / HEARTBEAT_FILE).touch, scoring=spec.scoring, checkpointing=spec.gradient_checkpointing)
    try:
        if spec.strategy == "fsdp":
            train_sharded(spec.base, train, evaluation, directory, spec.hyperparameters, node=spec.node, **common)
        else:
            train_adapter(spec.base, train, evaluation, directory, spec.hyperparameters, **common)
    except ApplianceError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
