"""Whether a training job fits this host before anything loads, and whether it needs gradient
checkpointing: what a trainer asks, and the answer. The installer's training planner answers
(installer.train_plan.local_job_fit, through the `appliance.job_fit` entry point: neither the core
nor finetune imports the installer)."""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

from appliance.errors import StateError

FIT_GROUP = "appliance.job_fit"
# glibc's mmap threshold in a CPU trainer's processes (MALLOC_MMAP_THRESHOLD_): a buffer this large
# or larger is mapped and goes back to the system when freed; a smaller one stays in malloc's
# arenas. Fixed, not glibc's dynamic one, which rises to keep ever larger freed buffers.
CPU_MMAP_THRESHOLD = 1 << 20


@dataclass(frozen=True)
class JobShape:
    """One training job as a process of it holds it."""

    base: Path  # the checkpoint's directory (its config.json)
    qlora: bool
    rank: int  # LoRA's
    seq_len: int  # tokens per row
    batch: int  # rows per micro-batch and process
    processes: int  # on each host
    sharded: bool  # FSDP splits the base over all the processes; DDP and one process hold it whole
    process_limit_bytes: int | None  # the sandbox's memory limit on each process; None: none
    hosts: int = 1  # the head and the worker hosts training beside it (alike: sized by this one)


@dataclass(frozen=True)
class JobFit:
    checkpointing: bool  # chosen only where the job does not fit without it
    process_bytes: int  # the estimate for one process, as chosen
    budget_bytes: int  # what one process may use here
    reason: str | None  # why it does not fit, naming the figure; None: it fits

    @property
    def fits(self) -> bool:
        return self.reason is None


def fit_job(shape: JobShape) -> JobFit:
    """The installed training planner's answer for `shape` on this host."""
    sources = list(entry_points(group=FIT_GROUP, name="local_job_fit"))
    if len(sources) != 1:
        raise StateError(f"{len(sources)} providers of {FIT_GROUP}:local_job_fit are installed; sizing a training "
                         "job needs exactly one (the installer's training planner)", hint="reinstall the appliance")
    found: JobFit = sources[0].load()(shape)
    return found
