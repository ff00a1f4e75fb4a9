"""A run's live figures: written by its worker into the run's directory, read by the CLI, the admin
API and the TUI."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from appliance.durable import replace_file
from appliance.home import Home
from appliance.jobs import PROGRESS_FILE
from appliance.rl.runs import Run, run_dir

RECENT_STEPS = 100  # a GRPO run's steps its live figures show


class PolicyStep(BaseModel):
    """One finished update of a GRPO run: the version it trained, what its group scored (the
    version before generated it) and the update's own figures."""

    model_config = ConfigDict(allow_inf_nan=False)

    step: int = Field(ge=0)
    version: int = Field(ge=1, description="The policy version this update registered and serves next.")
    generated_by: str = Field(description="The engine name that answered this step's group.")
    answers: int
    reward_mean: float
    reward_spread: float = Field(description="Standard deviation of the group's rewards.")
    pass_rate: float = Field(description="Share of the step's answers that passed every test.")
    kl: float = Field(description="Mean per-token KL of the policy to the base model over the update.")
    loss: float
    train_tokens: int = Field(description="Prompt and answer tokens the update saw (no padding).")
    sample_s: float = Field(description="Wall time generating and executing the group (they overlap).")
    generate_s: float = Field(description="The answers' generation time, added up.")
    execute_s: float = Field(description="The answers' execution time, added up.")
    update_s: float = Field(description="Wall time of the update, the trainer's start included.")


class PolicyProgress(BaseModel):
    """A GRPO run's live figures."""

    policy: str
    steps: int
    finished: int = Field(0, description="Updates finished.")
    done: list[PolicyStep] = Field(description=f"The last {RECENT_STEPS} finished updates, oldest first.")
    resumed_from: str | None = Field(None, description="The step and version it last resumed from, if it did.")


def policy_line(progress: PolicyProgress) -> str:
    """`GRPO step 3/8, policy v3: reward 0.41 +/- 0.30, pass rate 25%, KL 0.0012`: the last update's."""
    if not progress.done:
        line = f"GRPO step 0/{progress.steps}, the base model answering"
    else:
        last = progress.done[-1]
        line = (f"GRPO step {last.step + 1}/{progress.steps}, {progress.policy} v{last.version}: reward "
                f"{last.reward_mean:.3f} +/- {last.reward_spread:.3f}, pass rate {last.pass_rate:.0%}, "
                f"KL {last.kl:.4f}")
    return line + (f" (resumed at {progress.resumed_from})" if progress.resumed_from else "")


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
    policy: PolicyProgress | None = Field(None, description="A GRPO run's updates.")


def write_progress(home: Home, run_id: int, progress: RunProgress) -> None:
    replace_file(run_dir(home, run_id) / PROGRESS_FILE, progress.model_dump_json().encode())


def read_progress(home: Home, run_id: int) -> RunProgress | None:
    try:
        return RunProgress.model_validate_json((run_dir(home, run_id) / PROGRESS_FILE).read_bytes())
    except (OSError, ValueError):
        return None


class RunReport(Run):
    progress: RunProgress | None


def report(home: Home, run: Run) -> RunReport:
    return RunReport(**run.model_dump(), progress=read_progress(home, run.id))
