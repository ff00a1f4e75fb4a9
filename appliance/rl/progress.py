"""A run's live figures: written by its worker into the run's directory, read by the CLI, the admin
API and the TUI."""

from __future__ import annotations

from pydantic import BaseModel, Field

from appliance.durable import replace_file
from appliance.home import Home
from appliance.jobs import PROGRESS_FILE
from appliance.rl.runs import Run, run_dir


class RunProgress(BaseModel):
    """A run's live figures (written by its worker, read by the CLI, admin API and TUI)."""

    tasks: int
    attempts_done: int
    attempts_planned: int = Field(description="First answers; corrections are added as answers fail.")
    passed: int
    pass_rate: float = Field(description="Share of tasks with at least one passing attempt so far.")
    first_pass_rate: float = Field(description="Share of first answers (round 0) that passed.")
    mean_reward: float
    queue_depth: int = Field(description="Executions waiting for a sandbox worker.")
    workers: int = Field(description="Sandbox workers running.")
    trajectory_segments: int


def write_progress(home: Home, run_id: int, progress: RunProgress) -> None:
    replace_file(run_dir(home, run_id) / PROGRESS_FILE, progress.model_dump_json().encode(), mode=0o644)


def read_progress(home: Home, run_id: int) -> RunProgress | None:
    try:
        return RunProgress.model_validate_json((run_dir(home, run_id) / PROGRESS_FILE).read_bytes())
    except (OSError, ValueError):
        return None


class RunReport(Run):
    progress: RunProgress | None


def report(home: Home, run: Run) -> RunReport:
    return RunReport(**run.model_dump(), progress=read_progress(home, run.id))
