"""The `rl-worker` program (supervised): takes queued RL runs one at a time and runs each to its end
(finetune.rl.loop). A run left running by a worker that died is taken first and resumes from what
its store holds. Exports asked through the admin API (datasets from a run's trajectories) are made
between runs."""

from __future__ import annotations

import logging
import os
import time

from appliance.changes import Target
from appliance.errors import ApplianceError, Unavailable
from appliance.home import Home
from appliance.jobs import FINISHED, JobState
from appliance.rl import exports, runs
from appliance.settings import Settings
from appliance.supervisor import runs_module
from finetune.rl.export import export_run
from finetune.rl.loop import Loop, RunCancelled
from finetune.rl.policy import PolicyTraining
from finetune.worker import announce_outcome, serve_queue

log = logging.getLogger("appliance.rl-worker")


def work_one(home: Home, settings: Settings) -> runs.Run | exports.Export | None:
    """The next export, else the next run, done; None when there was neither."""
    return export_one(home, settings) or run_one(home, settings)


def export_one(home: Home, settings: Settings) -> exports.Export | None:
    """Make the next asked export, if any; returns it as it ended. While the artifact store is
    away it waits `rl.retry_s` and tries again, for up to `rl.give_up_s`."""
    export = exports.claim(home, os.getpid(), worker_alive)
    if export is None:
        return None
    if export.state in FINISHED:  # its workers died too often: the queue gave it up
        announce_outcome("rl.export", export.state, Target(kind="rl_export", name=str(export.id)),
                         f"export {export.id} of run {export.run_id} {export.state}: {export.message}", log)
        return export
    waited_since = time.monotonic()
    while True:
        try:
            state, message = JobState.SUCCEEDED, "; ".join(export_run(export.run_id, export, settings, home).lines())
        except Unavailable as exc:
            if time.monotonic() - waited_since < settings.rl.give_up_s:
                log.warning("export %d: %s; trying again in %g s", export.id, exc.one_line(), settings.rl.retry_s)
                time.sleep(settings.rl.retry_s)
                continue
            state, message = JobState.FAILED, exc.one_line()
        except ApplianceError as exc:
            state, message = JobState.FAILED, exc.one_line()
        except Exception as exc:  # a bug: this export fails, the worker goes on
            log.exception("export %d", export.id)
            state, message = JobState.FAILED, f"internal error: {type(exc).__name__}: {exc} (see the rl-worker's log)"
        break
    if not exports.finish(home, export.id, os.getpid(), state, message):
        log.warning("export %d was taken over by another worker; its outcome is theirs", export.id)
    else:
        announce_outcome("rl.export", state, Target(kind="rl_export", name=str(export.id)),
                         f"export {export.id} of run {export.run_id} {state}: {message}", log)
    return exports.get(home, export.id)


def run_one(home: Home, settings: Settings) -> runs.Run | None:
    """Run the next run, if any, to its end; returns it as it ended."""
    run = runs.claim(home, os.getpid(), worker_alive)
    if run is None:
        return None
    if run.state in FINISHED:  # its workers died too often: the queue gave it up
        announce_outcome("rl.run", run.state, Target(kind="rl_run", name=str(run.id)),
                         f"run {run.id} ({run.spec.base} on {run.spec.tasks}) {run.state}: {run.message}", log)
        return run
    log.info("run %d (%s on %s): attempt %d", run.id, run.spec.base, run.spec.tasks, run.attempts)
    while True:
        try:  # a run found cancelling (its worker died) stops at once, its trajectories kept
            loop = Loop(home, settings, run)
            try:
                message = PolicyTraining(loop).train() if run.spec.grpo else loop.execute()
            finally:
                loop.close()
            state = JobState.SUCCEEDED
        except RunCancelled as exc:
            state, message = JobState.CANCELLED, exc.message
        except Unavailable as exc:  # the gateway, Keycloak or the artifact store: wait, then resume
            if runs.get(home, run.id).state == JobState.CANCELLING:
                state, message = JobState.CANCELLED, f"cancelled while waiting: {exc.one_line()}"
            else:
                log.warning("run %d: %s; resuming in %g s", run.id, exc.one_line(), settings.rl.retry_s)
                runs.note(home, run.id, f"waiting to resume: {exc.one_line()}")
                runs.progressed(home, run.id, os.getpid())  # waiting on a service, not stuck: no watchdog
                time.sleep(settings.rl.retry_s)
                continue
        except ApplianceError as exc:
            state, message = JobState.FAILED, exc.one_line()
        except Exception as exc:  # an unexpected answer or a bug: the run fails, the worker goes on
            log.exception("run %d", run.id)
            state, message = JobState.FAILED, f"internal error: {type(exc).__name__}: {exc} (see the rl-worker's log)"
        break
    if runs.finish(home, run.id, state, message):
        announce_outcome("rl.run", state, Target(kind="rl_run", name=str(run.id)),
                         f"run {run.id} ({run.spec.base} on {run.spec.tasks}) {state}: {message}", log)
    else:  # another worker ended it first: its outcome is the one the queue and the audit log keep
        log.warning("run %d had already ended %s; this worker's outcome is not recorded: %s", run.id, state, message)
    return runs.get(home, run.id)


def worker_alive(pid: int | None) -> bool:
    """Whether the worker that claimed it still runs."""
    return runs_module(pid, "finetune.rl.worker")


if __name__ == "__main__":
    serve_queue(work_one, lambda settings: settings.rl.worker_poll_s, "rl-worker")
