"""The `rl-worker` program (supervised): takes queued RL runs one at a time and runs each to its end
(finetune.rl.loop). A run left running by a worker that died is taken first and resumes from what
its store holds. Exports asked through the admin API (datasets from a run's trajectories) are made
between runs."""

from __future__ import annotations

import logging
import os
import time

from appliance.errors import ApplianceError, Unavailable
from appliance.home import Home
from appliance.jobs import JobState
from appliance.rl import exports, runs
from appliance.settings import Settings
from appliance.supervisor import runs_module
from appliance.work_queues import ItemWork, one_at_a_time, serve_worker
from finetune.rl.export import export_run
from finetune.rl.loop import Loop, RunCancelled
from finetune.rl.policy import PolicyTraining

log = logging.getLogger("appliance.rl-worker")


def work_one(home: Home, settings: Settings) -> runs.Run | exports.Export | None:
    """The next export, else the next run, done; None when there was neither."""
    return Exports(home, settings, log).take_one() or Runs(home, settings, log).take_one()


class Exports(ItemWork[exports.Export]):
    """Exports asked through the admin API. While the artifact store is away an export waits
    `rl.retry_s` and is tried again, for up to `rl.give_up_s`."""

    action = "rl.export"
    target_kind = "rl_export"
    actor = "finetune-worker"  # the training workers' name in the audit log, the RL one's too

    def claim(self) -> exports.Export | None:
        return exports.claim(self.home, os.getpid(), worker_alive)

    def work(self, export: exports.Export) -> tuple[JobState, str]:
        settings, rl = self.settings, self.settings.rl
        waited_since = time.monotonic()
        while True:
            try:
                return JobState.SUCCEEDED, "; ".join(export_run(export.run_id, export, settings, self.home).lines())
            except Unavailable as exc:
                if time.monotonic() - waited_since >= rl.give_up_s:
                    return JobState.FAILED, exc.one_line()
                log.warning("export %d: %s; trying again in %g s", export.id, exc.one_line(), rl.retry_s)
                time.sleep(rl.retry_s)
            except ApplianceError as exc:
                return JobState.FAILED, exc.one_line()
            except Exception as exc:  # a bug: this export fails, the worker goes on
                log.exception("export %d", export.id)
                return JobState.FAILED, f"internal error: {type(exc).__name__}: {exc} (see the rl-worker's log)"

    def finish(self, export: exports.Export, state: JobState, message: str) -> bool:
        return exports.finish(self.home, export.id, os.getpid(), state, message)

    def get(self, export: exports.Export) -> exports.Export:
        return exports.get(self.home, export.id)

    def describe(self, export: exports.Export) -> str:
        return f"export {export.id} of run {export.run_id}"


class Runs(ItemWork[runs.Run]):
    """RL runs, each to its end (a run found cancelling, its worker dead, stops at once, its
    trajectories kept); while a service is away a run waits and resumes."""

    action = "rl.run"
    target_kind = "rl_run"
    actor = "finetune-worker"  # the training workers' name in the audit log, the RL one's too

    def claim(self) -> runs.Run | None:
        return runs.claim(self.home, os.getpid(), worker_alive)

    def work(self, run: runs.Run) -> tuple[JobState, str]:
        home, settings = self.home, self.settings
        log.info("run %d (%s on %s): attempt %d", run.id, run.spec.base, run.spec.tasks, run.attempts)
        while True:
            try:
                loop = Loop(home, settings, run)
                try:
                    return JobState.SUCCEEDED, PolicyTraining(loop).train() if run.spec.grpo else loop.execute()
                finally:
                    loop.close()
            except RunCancelled as exc:
                return JobState.CANCELLED, exc.message
            except Unavailable as exc:  # the gateway, Keycloak or the artifact store: wait, then resume
                if runs.get(home, run.id).state == JobState.CANCELLING:
                    return JobState.CANCELLED, f"cancelled while waiting: {exc.one_line()}"
                log.warning("run %d: %s; resuming in %g s", run.id, exc.one_line(), settings.rl.retry_s)
                runs.note(home, run.id, f"waiting to resume: {exc.one_line()}")
                runs.progressed(home, run.id, os.getpid())  # waiting on a service, not stuck: no watchdog
                time.sleep(settings.rl.retry_s)
            except ApplianceError as exc:
                return JobState.FAILED, exc.one_line()
            except Exception as exc:  # an unexpected answer or a bug: the run fails, the worker goes on
                log.exception("run %d", run.id)
                return JobState.FAILED, f"internal error: {type(exc).__name__}: {exc} (see the rl-worker's log)"

    def finish(self, run: runs.Run, state: JobState, message: str) -> bool:
        return runs.finish(self.home, run.id, state, message)

    def get(self, run: runs.Run) -> runs.Run:
        return runs.get(self.home, run.id)

    def describe(self, run: runs.Run) -> str:
        return f"run {run.id} ({run.spec.base} on {run.spec.tasks})"


def worker_alive(pid: int | None) -> bool:
    """Whether the worker that claimed it still runs."""
    return runs_module(pid, "finetune.rl.worker")


if __name__ == "__main__":
    serve_worker("rl-worker", one_at_a_time(work_one, lambda settings: settings.rl.worker_poll_s))
