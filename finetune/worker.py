"""The `finetune-worker` program (supervised): takes queued training jobs one at a time and runs
each to a registered adapter (finetune.runner). A job left running by a worker that died is taken
first and resumes from its last checkpoint."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

from appliance import jobs
from appliance.changes import Change, announce
from appliance.errors import ApplianceError
from appliance.home import HOME_ENV, Home
from appliance.programs import Program
from appliance.settings import Settings, load_settings
from appliance.supervisor import runs_module
from finetune.runner import end_stale_trainer, run_job
from finetune.train import TrainingCancelled

log = logging.getLogger("appliance.finetune-worker")


def work_one(home: Home, settings: Settings) -> jobs.Job | None:
    """Run the next job, if any, to its end; returns it as it ended."""
    job = jobs.claim(home, os.getpid(), worker_alive)
    if job is None:
        return None
    directory = jobs.job_dir(home, job.id)
    if job.trainer_pid is not None:  # left by a worker that died: its trainer must not run on beside ours
        end_stale_trainer(job.trainer_pid, directory)
    log.info("job %d (%s on %s): attempt %d", job.id, job.name, job.data, job.attempts)
    try:
        outcome = run_job(directory, name=job.name, data=job.data, base=job.base,
                          hp=job.hyperparameters, settings=settings, home=home,
                          eval_sets=job.eval_sets,
                          on_child=lambda pid: jobs.set_trainer(home, job.id, pid))
    except TrainingCancelled as exc:
        state, message = jobs.JobState.CANCELLED, exc.message
    except ApplianceError as exc:  # a tampered dataset (IntegrityError) among them
        state, message = jobs.JobState.FAILED, exc.message
    else:
        result, record = outcome.result, outcome.record
        verdict = "passed" if outcome.passed else "FAILED: " + "; ".join(outcome.failures)
        resumed = f", resumed from {result.resumed_from}" if result.resumed_from else ""
        state = jobs.JobState.SUCCEEDED if outcome.passed else jobs.JobState.FAILED
        message = (f"adapter {record.name} v{record.version}: held-out loss {result.base_eval_loss:.4f} -> "
                   f"{result.adapter_eval_loss:.4f} ({result.improvement:+.1%}); {result.steps} steps{resumed}; "
                   f"gate {verdict}")
    jobs.finish(home, job.id, state, message)
    try:  # the job's outcome in the audit log, as the CLI's changes are
        succeeded = state == jobs.JobState.SUCCEEDED
        announce(Change("finetune.job", "allowed" if succeeded else "error", 0 if succeeded else 1,
                        f"job {job.id} ({job.name} on {job.data}) {state}: {message}"))
    except ApplianceError as exc:
        log.error("job %d: %s", job.id, exc.one_line())
    return jobs.get(home, job.id)


def worker_alive(pid: int | None) -> bool:
    """Whether the worker that claimed it still runs."""
    return runs_module(pid, "finetune.worker")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))  # unwind: the trainer child stops too
    home = Home.from_env()
    settings = load_settings(home.settings_file)
    while True:
        if work_one(home, settings) is None:
            time.sleep(settings.finetune.worker_poll_s)


def worker_programs(settings: Settings, home: Home) -> list[Program]:
    """The `appliance.programs` entry point: one worker, after the engines and the gateway."""
    return [Program(name="finetune-worker", command=[sys.executable, "-P", "-m", "finetune.worker"],
                    environment={HOME_ENV: str(home.root)}, priority=95, startsecs=2, stopwaitsecs=30)]


if __name__ == "__main__":
    main()
