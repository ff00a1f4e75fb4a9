"""The watchdog's look at the work queues, on real queue databases: a worker holding a job with no
progress past its stall limit is ended (only a supervised worker of that queue, under the claim's
pid, checked again before the kill), each object is recorded once, and the job is then taken over
as a dead worker's is, given up after MAX_ATTEMPTS."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from appliance import jobs
from appliance.changes import Change
from appliance.home import Home
from appliance.queue import PROGRESS_COLUMN
from appliance.settings import WatchdogSettings
from appliance.supervisor import ProcessInfo, ProcessState
from serve.stuck_work import end_stuck_workers, stuck_items

LIMITS = WatchdogSettings(training_stall_s=60, rl_stall_s=60, batch_stall_s=60)


class Programs:
    """supervisord's answers: program name -> (state, pid); `changed` is what a second look finds."""

    def __init__(self, programs: dict[str, tuple[int, int]]) -> None:
        self.programs, self.changed = programs, dict(programs)

    @staticmethod
    def _info(name: str, state: int, pid: int) -> dict[str, Any]:
        return {"name": name, "state": state, "pid": pid, "now": 1000, "start": 400, "stdout_logfile": "/dev/null",
                "description": ""}

    def processes(self) -> list[ProcessInfo]:
        return [ProcessInfo.from_rpc(self._info(name, *found)) for name, found in self.programs.items()]

    def call(self, method: str, name: str) -> dict[str, Any]:
        assert method == "getProcessInfo"
        return self._info(name, *self.changed[name])


def submitted(home: Home) -> int:
    return jobs.submit(home, name="a", data="d", base="m", hyperparameters=jobs.Hyperparameters(), eval_sets={}).id


def age(home: Home, job_id: int, seconds: float) -> None:
    with jobs.connect(home) as db:
        db.execute(f"update jobs set {PROGRESS_COLUMN} = {PROGRESS_COLUMN} - ? where id = ?", (seconds, job_id))


def look(home: Home, programs: Programs) -> tuple[list[int], list[Change]]:
    killed: list[int] = []
    recorded: list[Change] = []
    end_stuck_workers(home, LIMITS, programs, killed.append, recorded.append)  # type: ignore[arg-type]
    return killed, recorded


def test_a_worker_whose_job_made_no_progress_is_ended_and_the_job_recorded(home: Home) -> None:
    job_id = submitted(home)
    assert jobs.claim(home, 4242, lambda pid: True) is not None
    running = Programs({"finetune-worker": (ProcessState.RUNNING, 4242), "batch-worker": (ProcessState.RUNNING, 77)})
    assert look(home, running) == ([], []), "claimed just now"
    age(home, job_id, 50)
    jobs.progressed(home, job_id, 4242)  # a step: the clock starts again
    age(home, job_id, 50)
    assert look(home, running) == ([], [])
    age(home, job_id, 20)
    killed, [record] = look(home, running)
    assert killed == [4242]
    assert (record.action, record.actor, record.target and record.target.kind, record.target and record.target.name) \
        == ("job.requeued", "watchdog", "job", str(job_id))
    assert "finetune-worker (pid 4242) ended: training job" in (record.detail or "")
    assert "no progress for 70 s (attempt 1)" in (record.detail or "")


@pytest.mark.parametrize("programs", [
    {"finetune-worker": (ProcessState.RUNNING, 999)},  # the claimer is dead: already an orphan
    {"rl-worker": (ProcessState.RUNNING, 4242)},  # the pid is another program's
    {"finetune-worker": (ProcessState.STOPPING, 4242)},
], ids=["dead-claimer", "another-program", "not-running"])
def test_no_process_but_the_queues_running_worker_is_ended(home: Home, programs: dict[str, tuple[int, int]]) -> None:
    job_id = submitted(home)
    assert jobs.claim(home, 4242, lambda pid: True) is not None
    age(home, job_id, 100)
    assert [item.item.key for item in stuck_items(home, LIMITS)] == [job_id]
    assert look(home, Programs(programs)) == ([], [])


def test_a_worker_started_again_meanwhile_is_not_ended(home: Home) -> None:
    job_id = submitted(home)
    assert jobs.claim(home, 4242, lambda pid: True) is not None
    age(home, job_id, 100)
    restarted = Programs({"finetune-worker": (ProcessState.RUNNING, 4242)})
    restarted.changed["finetune-worker"] = (ProcessState.RUNNING, 5151)
    assert look(home, restarted) == ([], [])


def test_a_job_is_taken_over_after_its_worker_is_ended_and_given_up_after_max_attempts(home: Home) -> None:
    job_id = submitted(home)
    for worker in range(1, jobs.MAX_ATTEMPTS + 1):
        claimed = jobs.claim(home, worker, lambda pid: False)  # each earlier worker was ended
        assert claimed is not None and (claimed.id, claimed.state, claimed.attempts) == (job_id, "running", worker)
    given_up = jobs.claim(home, 99, lambda pid: False)
    assert given_up is not None and given_up.state == "failed"
    assert given_up.message == (f"given up after {jobs.MAX_ATTEMPTS} attempts: each one's worker died or was ended "
                                "by the watchdog for making no progress")
    assert jobs.claim(home, 99, lambda pid: False) is None


def test_a_job_given_up_while_cancelling_ends_cancelled(home: Home) -> None:
    job_id = submitted(home)
    assert jobs.claim(home, 1, lambda pid: False) is not None
    assert jobs.cancel(home, job_id).state == "cancelling"
    for worker in range(2, jobs.MAX_ATTEMPTS + 1):
        assert jobs.claim(home, worker, lambda pid: False) is not None
    ended = jobs.claim(home, 99, lambda pid: False)
    assert ended is not None and ended.state == "cancelled" and "its worker had died 3 times" in (ended.message or "")


def test_only_a_plain_heartbeat_file_is_a_beat(tmp_path: Path) -> None:
    from finetune.runner import beat_time

    assert beat_time(tmp_path) is None
    (tmp_path / jobs.HEARTBEAT_FILE).symlink_to("/proc/uptime")  # a file that always changes: no beat
    assert beat_time(tmp_path) is None
    (tmp_path / jobs.HEARTBEAT_FILE).unlink()
    (tmp_path / jobs.HEARTBEAT_FILE).symlink_to(jobs.HEARTBEAT_FILE)  # a loop: no beat, and no error
    assert beat_time(tmp_path) is None
    (tmp_path / jobs.HEARTBEAT_FILE).unlink()
    (tmp_path / jobs.HEARTBEAT_FILE).mkdir()
    assert beat_time(tmp_path) is None
    (tmp_path / jobs.HEARTBEAT_FILE).rmdir()
    (tmp_path / jobs.HEARTBEAT_FILE).touch()
    assert beat_time(tmp_path) == (tmp_path / jobs.HEARTBEAT_FILE).stat().st_mtime
