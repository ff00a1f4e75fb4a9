"""The `rl-worker` program (supervised): takes queued RL runs one at a time and runs each to its end
(finetune.rl.loop). A run left running by a worker that died is taken first and resumes from what
its store holds."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

from appliance import rl
from appliance.changes import Change, announce
from appliance.errors import ApplianceError
from appliance.home import HOME_ENV, Home
from appliance.jobs import JobState
from appliance.programs import Program
from appliance.settings import Settings, load_settings
from appliance.supervisor import runs_module
from finetune.rl.loop import Loop, RunCancelled

log = logging.getLogger("appliance.rl-worker")


def work_one(home: Home, settings: Settings) -> rl.Run | None:
    """Run the next run, if any, to its end; returns it as it ended."""
    run = rl.claim(home, os.getpid(), worker_alive)
    if run is None:
        return None
    log.info("run %d (%s on %s): attempt %d", run.id, run.spec.base, run.spec.tasks, run.attempts)
    try:
        if run.state == JobState.CANCELLING:
            raise RunCancelled("run stopped as asked; its attempts so far are kept")
        message = Loop(home, settings, run).execute()
        state = JobState.SUCCEEDED
    except RunCancelled as exc:
        state, message = JobState.CANCELLED, exc.message
    except ApplianceError as exc:
        state, message = JobState.FAILED, exc.one_line()
    except Exception as exc:  # an unexpected answer or a bug: the run fails, the worker goes on
        log.exception("run %d", run.id)
        state, message = JobState.FAILED, f"internal error: {type(exc).__name__}: {exc} (see the rl-worker's log)"
    rl.finish(home, run.id, state, message)
    try:
        succeeded = state == JobState.SUCCEEDED
        announce(Change("rl.run", "allowed" if succeeded else "error", 0 if succeeded else 1,
                        f"run {run.id} ({run.spec.base} on {run.spec.tasks}) {state}: {message}"))
    except ApplianceError as exc:
        log.error("run %d: %s", run.id, exc.one_line())
    return rl.get(home, run.id)


def worker_alive(pid: int | None) -> bool:
    """Whether the worker that claimed it still runs."""
    return runs_module(pid, "finetune.rl.worker")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))  # unwind: the sandbox workers stop too
    home = Home.from_env()
    settings = load_settings(home.settings_file)
    while True:
        if work_one(home, settings) is None:
            time.sleep(settings.rl.worker_poll_s)


def worker_programs(settings: Settings, home: Home) -> list[Program]:
    """The `appliance.programs` entry point: one RL worker, after the engines and the gateway."""
    return [Program(name="rl-worker", command=[sys.executable, "-P", "-m", "finetune.rl.worker"],
                    environment={HOME_ENV: str(home.root)}, priority=96, startsecs=2, stopwaitsecs=30)]


if __name__ == "__main__":
    main()
