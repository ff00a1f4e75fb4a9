"""Fine-tuning's settings: evaluation, the gate, the trainer's sandbox and how ranks train."""

from __future__ import annotations

from ipaddress import IPv4Network
from typing import Literal

from pydantic import Field, field_validator

from appliance.settings.section import Section


class FinetuneSettings(Section):
    """Post-training: datasets, training jobs and their gate (what sensitive data in a dataset gets:
    `compliance.training_data`)."""

    IN_SUPERVISOR_CONFIG = False  # read by the programs from the settings file

    eval_fraction: float = Field(0.1, ge=0, lt=1, description="Share of rows held out for evaluation.")
    gate_min_improvement: float = Field(
        0.0, ge=0, lt=1, description="An adapter passes the gate when its held-out loss is at least this "
        "much lower than the base model's (0.05 = 5 %; 0 = any improvement)."
    )
    gate_min_scenario_score: float = Field(
        0.0, ge=0, le=1, description="With a scenario set: the share of its items the adapter must answer "
        "right (it must also do no worse than the base model)."
    )
    gate_max_regression_drop: float = Field(
        0.05, ge=0, le=1, description="With a regression set: how far the adapter's mean score may fall below "
        "the base model's (forgetting)."
    )
    gate_seeds: int = Field(
        3, ge=1, le=20, description="Each evaluation set is answered this many times, each with its own sampling "
        "seed; the gate judges the mean score and records each seed's and the spread (1: one greedy answer)."
    )
    gate_temperature: float = Field(
        0.5, gt=0, le=2, description="Sampling temperature of the evaluation answers when gate_seeds > 1."
    )
    regression_set: Literal["shipped", "none"] = Field(
        "shipped", description="What a job with no regression set of its own is checked against for forgetting: "
        "the general-capability prompts the appliance ships, or none (forgetting goes unchecked: say so to "
        "your auditor)."
    )
    sandbox: Literal["bubblewrap", "none"] = Field(
        "bubblewrap", description="Run each trainer in a bubblewrap sandbox (as user appliance-train when the "
        "appliance runs as root; only its model, dataset and job directory visible; no network; memory and "
        "process caps); none: a plain child process with the host's view (say so to your auditor)."
    )
    sandbox_memory_gib: float | None = Field(
        None, gt=0, description="The trainer's data memory cap, GiB (unset: 80 % of the host's RAM)."
    )
    sandbox_max_processes: int = Field(
        4096, ge=16, description="Processes and threads the sandbox's user may run at once."
    )
    max_job_hours: float = Field(
        48.0, gt=0, description="A trainer still running after this many hours is ended and its job fails "
        "(each worker's run of it counts on its own): a runaway or hostile trainer that keeps beating cannot "
        "hold the worker for ever."
    )
    processes: int | None = Field(
        None, ge=1, description="Training processes (ranks, torchrun); unset: one per visible GPU, at least one "
        "(`finetune run|submit --processes N` overrides it for a job)."
    )
    strategy: Literal["auto", "fsdp", "ddp", "single"] = Field(
        "auto", description="How several processes train: fsdp shards the base, the adapter and the optimizer "
        "state over them (no process holds the whole base); ddp gives each a whole copy; single trains in one "
        "process. auto: single for one process, otherwise fsdp (ddp for DPO, which the sharded trainer does not run)."
    )
    worker_poll_s: float = Field(2.0, gt=0, description="How often the finetune-worker looks for queued jobs.")
    training_subnet: IPv4Network = Field(
        IPv4Network("10.77.0.0/16"), description="A job over several hosts runs each host's ranks in a network "
        "namespace with an address from this /16 (host N of the job: its Nth /24), routed between the job's "
        "hosts and reached by no one else; choose one no network of the site uses."
    )

    @field_validator("training_subnet")
    @classmethod
    def _a_private_16(cls, subnet: IPv4Network) -> IPv4Network:
        if subnet.prefixlen != 16 or not subnet.is_private:
            raise ValueError(f"{subnet}: must be a private /16 (a /24 for each host of a job), e.g. 10.77.0.0/16")
        return subnet
