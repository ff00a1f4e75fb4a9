"""A training job's life is a checked state machine: every move is made in one transaction and an
illegal one names the state and the move."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance import jobs
from appliance.errors import IllegalTransition, NotFound
from appliance.home import Home
from appliance.jobs import CANCEL_FILE, Hyperparameters, JobState


def submitted(home: Home) -> jobs.Job:
    return jobs.submit(home, name="a", data="d", base="demo", hyperparameters=Hyperparameters(), eval_sets={})


def test_a_job_runs_and_finishes_once(home: Home) -> None:
    job = submitted(home)
    with pytest.raises(IllegalTransition, match=f"training job {job.id} is queued: it cannot become succeeded"):
        jobs.finish(home, job.id, JobState.SUCCEEDED, "too early")
    claimed = jobs.claim(home, 123, alive=lambda pid: True)
    assert claimed is not None and (claimed.state, claimed.worker_pid, claimed.attempts) == ("running", 123, 1)
    with pytest.raises(IllegalTransition, match="cannot finish as running"):
        jobs.finish(home, job.id, JobState.RUNNING, "not an end")
    assert jobs.finish(home, job.id, JobState.SUCCEEDED, "done")
    # Ended so again (a second worker that took it for dead): nothing changes, and the caller is told.
    assert not jobs.finish(home, job.id, JobState.SUCCEEDED, "a second worker's outcome")
    with pytest.raises(IllegalTransition, match="has already succeeded: it cannot become failed"):
        jobs.finish(home, job.id, JobState.FAILED, "twice")
    with pytest.raises(IllegalTransition, match="has already succeeded: it cannot become cancelling"):
        jobs.cancel(home, job.id)
    assert jobs.get(home, job.id).message == "done"  # nothing an illegal move tried was kept
    with pytest.raises(NotFound, match="no training job 99"):
        jobs.cancel(home, 99)


def test_cancel_a_queued_job_at_once_and_a_running_one_through_its_worker(home: Home) -> None:
    queued, running = submitted(home), submitted(home)
    assert jobs.cancel(home, queued.id).state == JobState.CANCELLED
    with pytest.raises(IllegalTransition, match="has already been cancelled"):
        jobs.cancel(home, queued.id)
    assert jobs.claim(home, 7, alive=lambda pid: True).id == running.id
    stopping = jobs.cancel(home, running.id)
    assert stopping.state == JobState.CANCELLING and (jobs.job_dir(home, running.id) / CANCEL_FILE).exists()
    # Its worker died: the next one takes it up still cancelling (its runner stops at once).
    resumed = jobs.claim(home, 8, alive=lambda pid: False)
    assert resumed is not None and (resumed.id, resumed.state, resumed.attempts) == (running.id, "cancelling", 2)
    jobs.finish(home, running.id, JobState.CANCELLED, "stopped")
    assert jobs.get(home, running.id).state == JobState.CANCELLED and jobs.claim(home, 9, lambda pid: True) is None


def test_every_state_is_in_the_machine_and_the_ends_lead_nowhere() -> None:
    assert set(jobs.MOVES) == set(JobState)
    assert all(not jobs.MOVES[end] for end in jobs.FINISHED)


def test_a_progress_report_is_read_only_from_a_small_regular_file(tmp_path: Path) -> None:
    """progress.json is written by the sandboxed trainer: a link to a device or a FIFO is no report."""
    import os

    jobs.write_progress(tmp_path, jobs.Progress(step=1, max_steps=2, loss=float("nan"), tokens_per_s=3.0, eta_s=None))
    report = jobs.read_progress(tmp_path)
    assert report is not None and report.step == 1 and report.loss != report.loss  # NaN travels, as "NaN"
    (tmp_path / jobs.PROGRESS_FILE).unlink()
    (tmp_path / jobs.PROGRESS_FILE).symlink_to("/dev/zero")
    assert jobs.read_progress(tmp_path) is None
    (tmp_path / jobs.PROGRESS_FILE).unlink()
    os.mkfifo(tmp_path / jobs.PROGRESS_FILE)
    assert jobs.read_progress(tmp_path) is None
