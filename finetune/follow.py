"""A training job followed as it runs (`appliance finetune status -f`, and `finetune run`'s bar):
on a terminal a bar for each phase with that phase's own total (steps while it trains, evaluations
while the gate evaluates); anywhere else (a pipe, a log) one plain line, flushed, each time its
state or progress changes."""

from __future__ import annotations

import time

import typer
from rich.console import Console
from rich.progress import Progress, TaskID

from appliance import jobs
from appliance.home import Home
from appliance.progress import byte_progress

POLL_S = 1.0  # how often the job's row and progress report are read


def amount(p: jobs.Progress | None) -> tuple[int, int | None, str]:
    """How far into its phase a job is, of how many of what (None: no total to show)."""
    if p is None or p.phase == jobs.Phase.REGISTERING:
        return 0, None, "steps"
    if p.phase == jobs.Phase.EVALUATING:
        return p.evaluations, p.evaluations_total or None, "evaluations"
    return p.step, p.max_steps or None, "steps"


class PhaseBar:
    """A Rich bar per phase of a job, each with its phase's own total and ETA."""

    def __init__(self, bar: Progress) -> None:
        self._bar = bar
        self._task: TaskID | None = None
        self._kind: tuple[jobs.Phase | None, int | None] | None = None

    def show(self, description: str, p: jobs.Progress | None) -> None:
        done, total, unit = amount(p)
        kind = (p.phase if p else None, total)
        if self._task is None or kind != self._kind:  # a new phase or total: a new bar, its rate its own
            if self._task is not None:
                self._bar.remove_task(self._task)
            self._task, self._kind = self._bar.add_task(description, total=total, unit=unit), kind
        self._bar.update(self._task, description=description, completed=done)


def line(job: jobs.Job, p: jobs.Progress | None) -> str:
    """The job's state and its progress (`p`, its latest report) in one line."""
    progress = "" if p is None else " " + jobs.progress_line(p, running=job.state == jobs.JobState.RUNNING)
    return f"job {job.id}: {job.state}{progress}"


def follow(home: Home, job_id: int, out: Console) -> None:
    """Show one job until it ends; exit status 1 unless it succeeded."""
    found = jobs.get(home, job_id)
    if out.is_terminal:
        with byte_progress() as bar:
            shown = PhaseBar(bar)
            while found.state not in jobs.FINISHED:
                p = jobs.read_progress(jobs.job_dir(home, job_id))
                shown.show(line(found, p), p)
                time.sleep(POLL_S)
                found = jobs.get(home, job_id)
    else:
        said = None
        while found.state not in jobs.FINISHED:
            if (now := line(found, jobs.read_progress(jobs.job_dir(home, job_id)))) != said:
                out.print(now, markup=False, highlight=False, soft_wrap=True)  # Rich flushes each print
                said = now
            time.sleep(POLL_S)
            found = jobs.get(home, job_id)
    out.print(f"job {job_id} {found.state}: {found.message or ''}", markup=False, highlight=False, soft_wrap=True)
    if found.state != jobs.JobState.SUCCEEDED:
        raise typer.Exit(1)
