"""The `finetune-worker` program (supervised): takes queued training jobs one at a time and runs
each to a registered adapter (finetune.runner). A job left running by a worker that died is taken
first and resumes from its last checkpoint."""

from __future__ import annotations

import logging
import os
import sqlite3

from appliance import jobs
from appliance.errors import ApplianceError
from appliance.home import Home
from appliance.settings import Settings
from appliance.supervisor import runs_module
from appliance.work_queues import ItemWork, one_at_a_time, serve_worker
from finetune.runner import end_stale_trainer, run_job
from finetune.train import TrainingCancelled

log = logging.getLogger("appliance.finetune-worker")


class Jobs(ItemWork[jobs.Job]):
    """Training jobs, to a registered adapter."""

    action = "finetune.job"
    target_kind = "job"
    actor = "finetune-worker"

    def claim(self) -> jobs.Job | None:
        job = jobs.claim(self.home, os.getpid(), worker_alive)
        if job is not None and job.trainer_pid is not None:  # left by a worker that died: its trainer
            end_stale_trainer(job.trainer_pid, jobs.job_dir(self.home, job.id))  # must not run on beside ours
        return job

    def work(self, job: jobs.Job) -> tuple[jobs.JobState, str]:
        log.info("job %d (%s on %s): attempt %d", job.id, job.name, job.data, job.attempts)
        home = self.home
        try:
            outcome = run_job(jobs.job_dir(home, job.id), name=job.name, data=job.data, base=job.base,
                              hp=job.hyperparameters, settings=self.settings, home=home, eval_sets=job.eval_sets,
                              on_child=lambda pid: jobs.set_trainer(home, job.id, pid),
                              on_beat=lambda: beat(home, job.id))
        except TrainingCancelled as exc:
            return jobs.JobState.CANCELLED, exc.message
        except ApplianceError as exc:  # a tampered dataset (IntegrityError) among them
            return jobs.JobState.FAILED, exc.message
        result, record = outcome.result, outcome.record
        verdict = "passed" if outcome.passed else "FAILED: " + "; ".join(outcome.failures)
        resumed = f", resumed from {result.resumed_from}" if result.resumed_from else ""
        return (jobs.JobState.SUCCEEDED if outcome.passed else jobs.JobState.FAILED,
                f"adapter {record.name} v{record.version}: held-out loss {result.base_eval_loss:.4f} -> "
                f"{result.adapter_eval_loss:.4f} ({result.improvement:+.1%}); {result.steps} steps{resumed}; "
                f"gate {verdict}")

    def finish(self, job: jobs.Job, state: jobs.JobState, message: str) -> bool:
        return jobs.finish(self.home, job.id, state, message)

    def get(self, job: jobs.Job) -> jobs.Job:
        return jobs.get(self.home, job.id)

    def describe(self, job: jobs.Job) -> str:
        return f"job {job.id} ({job.name} on {job.data})"


def work_one(home: Home, settings: Settings) -> jobs.Job | None:
    """Run the next job, if any, to its end; returns it as it ended."""
    return Jobs(home, settings, log).take_one()


def beat(home: Home, job_id: int) -> None:
    """Stamp the job's progress (the watchdog's clock); a database that cannot take it now is said,
    never a failed job (the next beat tries again)."""
    try:
        jobs.progressed(home, job_id, os.getpid())
    except (sqlite3.Error, OSError) as exc:
        log.warning("job %d: progress not stamped: %s", job_id, exc)


def worker_alive(pid: int | None) -> bool:
    """Whether the worker that claimed it still runs."""
    return runs_module(pid, "finetune.worker")


if __name__ == "__main__":
    serve_worker("finetune-worker", one_at_a_time(work_one, lambda settings: settings.finetune.worker_poll_s))
