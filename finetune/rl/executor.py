"""Sandbox workers: processes that take executions from a run's queue (finetune.rl.store) and run
each in the execution sandbox (finetune.rl.execute; one cell per worker), and the pool that keeps their number in step
with the queue's depth, within `execution.workers`.

A worker ends with its pool (the parent-death signal) and by itself after `execution.worker_idle_s`
without work; the execution of one that is killed goes back to the queue.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from appliance.errors import Unavailable
from appliance.home import Home
from appliance.rl.executions import GIVE_UP_CLAIMS
from appliance.settings import ExecutionSettings, load_settings
from appliance.supervisor import runs_module
from finetune.rl.execute import Sandbox, not_run
from finetune.rl.store import RunStore

log = logging.getLogger("appliance.rl-executor")
PR_SET_PDEATHSIG = 1
FAILURES_PER_WORKER = 5  # sandbox workers ending in error, per worker of the cap, before the run waits


def work(store: RunStore, settings: ExecutionSettings) -> int:
    """Run executions until none has come for `worker_idle_s`; returns how many it ran."""
    try:
        with Sandbox(settings) as sandbox:
            return _work(store, settings, sandbox)
    finally:
        store.close()


def _work(store: RunStore, settings: ExecutionSettings, sandbox: Sandbox) -> int:
    done, idle_since = 0, time.monotonic()
    while time.monotonic() - idle_since < settings.worker_idle_s:
        execution = store.claim(os.getpid())
        if execution is None:
            time.sleep(0.05)
            continue
        task = execution.task
        try:
            verdict = sandbox.run(execution.program, task.language, tests=task.tests,
                                  io_cases=[case.model_dump() for case in task.cases] if task.cases is not None
                                  else None, entry_point=task.entry_point,
                                  wall_s=min(settings.wall_s, task.time_limit_s + 5),
                                  test_wall_s=min(settings.test_wall_s, task.time_limit_s), prompt=task.prompt_code())
        except Exception as exc:  # the sandbox itself failed (a full /tmp, a missing tool): not the program
            log.exception("execution %s", execution.key)
            if execution.claims < GIVE_UP_CLAIMS:
                store.release(execution.id, os.getpid())
                time.sleep(1)
                continue
            verdict = not_run(f"the sandbox could not run it ({type(exc).__name__}: {exc})"[:500])
        if not store.complete(execution.id, os.getpid(), verdict):
            log.warning("execution %s was taken over by another worker; its verdict is theirs", execution.key)
        done += 1
        idle_since = time.monotonic()
    return done


def executor_alive(pid: int | None) -> bool:
    """Whether a sandbox worker with this pid still runs (not another program with its number)."""
    return runs_module(pid, "finetune.rl.executor")


class WorkerPool:
    """Sandbox workers for one run's queue, started as the queue grows, up to `cap`."""

    def __init__(self, store: RunStore, home: Home, cap: int) -> None:
        self.store = store
        self.home = home
        self.cap = cap
        self.workers: list[subprocess.Popen[bytes]] = []
        self.failures = 0

    def alive(self) -> int:
        """Workers running; Unavailable once they have failed too often (they cannot start, say)."""
        ended = [worker for worker in self.workers if worker.poll() is not None]
        self.failures += sum(worker.returncode != 0 for worker in ended)
        self.workers = [worker for worker in self.workers if worker.returncode is None]
        if self.failures > FAILURES_PER_WORKER * self.cap:
            raise Unavailable(f"sandbox workers ended in error {self.failures} times (the last: exit "
                              f"{ended[-1].returncode if ended else '?'})", hint="see the rl-worker's log")
        return len(self.workers)

    def follow(self, depth: int) -> None:
        """Start workers while the queue holds more executions than there are workers."""
        running = self.alive()
        for _ in range(min(self.cap, depth) - running):
            self.workers.append(subprocess.Popen(
                [sys.executable, "-P", "-m", "finetune.rl.executor", str(self.store.path)],
                env={**os.environ, "APPLIANCE_HOME": str(self.home.root)}, stdin=subprocess.DEVNULL))

    def stop(self) -> None:
        for worker in self.workers:
            if worker.poll() is None:
                worker.send_signal(signal.SIGTERM)
        for worker in self.workers:
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        self.workers = []


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # End with the pool that started us: a pool killed outright leaves no worker behind.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    settings = load_settings(Home.from_env().settings_file).execution
    work(RunStore(Path(sys.argv[1])), settings)


if __name__ == "__main__":
    main()
