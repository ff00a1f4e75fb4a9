"""The `finetune-worker` program (supervised): takes queued training jobs one at a time and runs
each to a registered adapter (finetune.runner). A job left running by a worker that died is taken
first and resumes from its last checkpoint."""

from __future__ import annotations

import logging
import os
import signal
import sqlite3
import sys
import time
from collections.abc import Callable

from appliance import jobs
from appliance.changes import Change, Target, announce
from appliance.errors import ApplianceError
from appliance.home import Home
from appliance.settings import Settings, load_settings
from appliance.supervisor import runs_module
from appliance.work_queues import hand_back
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
    if job.state in jobs.FINISHED:  # its workers died too often: the queue gave it up
        announce_outcome("finetune.job", job.state, Target(kind="job", name=str(job.id)),
                         f"job {job.id} ({job.name} on {job.data}) {job.state}: {job.message}", log)
        return job
    log.info("job %d (%s on %s): attempt %d", job.id, job.name, job.data, job.attempts)
    try:
        outcome = run_job(directory, name=job.name, data=job.data, base=job.base,
                          hp=job.hyperparameters, settings=settings, home=home,
                          eval_sets=job.eval_sets,
                          on_child=lambda pid: jobs.set_trainer(home, job.id, pid),
                          on_beat=lambda: beat(home, job.id))
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
    if jobs.finish(home, job.id, state, message):
        announce_outcome("finetune.job", state, Target(kind="job", name=str(job.id)),
                         f"job {job.id} ({job.name} on {job.data}) {state}: {message}", log)
    else:  # another worker ended it first: its outcome is the one the queue and the audit log keep
        log.warning("job %d had already ended %s; this worker's outcome is not recorded: %s", job.id, state, message)
    return jobs.get(home, job.id)


def beat(home: Home, job_id: int) -> None:
    """Stamp the job's progress (the watchdog's clock); a database that cannot take it now is said,
    never a failed job (the next beat tries again)."""
    try:
        jobs.progressed(home, job_id, os.getpid())
    except (sqlite3.Error, OSError) as exc:
        log.warning("job %d: progress not stamped: %s", job_id, exc)


def announce_outcome(action: str, state: jobs.JobState, target: Target, detail: str, log: logging.Logger) -> None:
    """A job's or a run's outcome in the audit log, as the CLI's changes are, by the training
    worker (one that cannot be recorded is logged: the work is done either way)."""
    succeeded = state == jobs.JobState.SUCCEEDED
    try:
        announce(Change(action, "allowed" if succeeded else "error", 0 if succeeded else 1, target,
                        detail if succeeded else None, error=None if succeeded else detail, actor="finetune-worker"))
    except ApplianceError as exc:
        log.error("%s (%s) not recorded in the audit log: %s", action, detail[:200], exc.one_line())


def worker_alive(pid: int | None) -> bool:
    """Whether the worker that claimed it still runs."""
    return runs_module(pid, "finetune.worker")


def serve_queue(work_one: Callable[[Home, Settings], object | None], poll_s: Callable[[Settings], float],
                program: str) -> None:
    """A queue worker's life (this one's, and the RL worker's): take work until there is none, wait
    `poll_s`, again; SIGTERM unwinds, so what the work started (a trainer, sandbox workers) stops too,
    and the attempts of what it held are handed back (a stop asked for is not a death)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    home = Home.from_env()
    settings = load_settings(home.settings_file)
    try:
        while True:
            if work_one(home, settings) is None:
                time.sleep(poll_s(settings))
    except SystemExit:
        hand_back(home, program, os.getpid())
        raise


if __name__ == "__main__":
    serve_queue(work_one, lambda settings: settings.finetune.worker_poll_s, "finetune-worker")
