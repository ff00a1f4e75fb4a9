"""Post-training from execution feedback: the task sets, RL runs with their live figures (pass
rate, rewards, sandbox queue depth and workers; cancel, export of their SFT and DPO sets), and a
finished run's trajectories: its attempts, and one attempt's code with the error fed back for its
correction."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Label, Static

from appliance.jobs import FINISHED, JobState
from appliance.rl.attempts import Attempt
from appliance.rl.exports import default_ask
from appliance.rl.progress import RunReport, policy_line
from appliance.rl.tasks import TaskSet
from appliance.terminal import shown
from tui.panel import Panel, clip

CANCELLABLE = (JobState.QUEUED, JobState.RUNNING)


def attempt_text(attempt: Attempt) -> Text:
    """One attempt in full: its code, what the sandbox said, and the error fed back."""
    text = shown(f"{attempt.task} sample {attempt.sample} round {attempt.round}: {attempt.status} "
                 f"({attempt.exit_reason}), {attempt.tests_passed}/{attempt.tests_total} tests, "
                 f"reward {attempt.reward:.3f}\n")
    text.stylize("bold")
    text.append_text(shown(attempt.code))
    if attempt.feedback:
        text.append("\n--- fed back for the next round\n", style="bold")
        text.append_text(shown(attempt.feedback))
    return text


def run_line(run: RunReport) -> str:
    """The selected run's figures the table has no room for, and what its worker said."""
    spec, p = run.spec, run.progress
    if spec.grpo is not None:
        line = (f"Run {run.id}: GRPO of {spec.grpo.policy} on {spec.tasks} ({spec.split}), groups of {spec.samples}, "
                f"{spec.grpo.tasks_per_step} tasks a step")
        if p is not None and p.policy is not None:
            line += f"; {policy_line(p.policy)}"
    else:
        line = (f"Run {run.id}: {spec.tasks} ({spec.split}), {spec.samples} samples a task, up to {spec.rounds} "
                "corrections")
        if p is not None:
            line += f"; first answers passed {p.first_pass_rate:.0%}"
    if p is not None:
        line += f"; {p.attempts_done}/{p.attempts_planned} attempts, mean reward {p.mean_reward:.3f}"
    if p is not None and run.state == JobState.RUNNING:
        line += f"; sandbox queue {p.queue_depth}, {p.workers} workers"
    return f"{line}\n{run.message}" if run.message else line


def run_cells(run: RunReport) -> tuple[object, ...]:
    """A run's row: what it trains on, whole (its attempts and reward are in `run_line`, to keep
    80 columns), and how far it got."""
    p = run.progress
    return (run.id, shown(run.spec.adapter or run.spec.base), shown(run.spec.tasks), run.state,
            f"{p.pass_rate:.0%}" if p else "-")


class RlRuns(Panel):
    REFRESH_S = 2.0
    DEFAULT_CSS = Panel.DEFAULT_CSS + """
    #tasksets { height: auto; max-height: 6; }
    #runs { height: 1fr; }
    #run { height: auto; max-height: 3; padding: 0 1; }
    #attempts { height: 1fr; }
    #attempt { height: auto; max-height: 16; overflow-y: auto; padding: 0 1; }
    Label { padding: 0 1; text-style: bold; }
    """
    # Listed in the titles (the footer lists the screens).
    BINDINGS = [Binding("c", "cancel_run", "cancel", show=False),
                Binding("t", "trajectories", "trajectories", show=False),
                Binding("x", "export", "export SFT and DPO sets", show=False),
                Binding("E", "episodes", "agent episodes", show=False)]
    EMPTY = {"tasksets": "No task sets yet: add the starter set with `appliance rl tasks add-starter`, or your own "
                         "with `appliance rl tasks add`.",
             "runs": "No RL runs yet: queue one on a task set with `appliance rl run`.",
             "attempts": "Select a finished run above and press t to read its attempts."}

    def __init__(self) -> None:
        super().__init__()
        self.runs: dict[str, RunReport] = {}
        self.attempts: dict[str, Attempt] = {}

    def body(self) -> ComposeResult:
        yield Label("Task sets", id="tasksets-title")
        yield from self.listing("tasksets")
        yield Label("RL runs", id="runs-title")
        yield from self.listing("runs")
        yield Static("", id="run", markup=False)
        yield Label("Attempts (enter: show one)", id="attempts-title")
        yield from self.listing("attempts")
        yield Static("", id="attempt", markup=False)

    def on_mount(self) -> None:
        self.query_one("#tasksets", DataTable).add_columns("name", "tasks", "train", "held out", "source",
                                                         "sha256", "added")
        self.query_one("#runs", DataTable).add_columns("run", "model", "tasks", "state", "pass")
        self.query_one("#attempts", DataTable).add_columns("task", "sample", "round", "status", "tests", "reward",
                                                         "why")
        self.fill("attempts", [])  # none until asked for: its note says how

    async def load(self) -> None:
        tasksets = [TaskSet.model_validate(t) for t in await self.client.call("GET", "/rl/tasksets")]
        self.fill("tasksets", [(t.name, (shown(t.name), t.tasks, t.train, t.held_out,
                                         shown(clip(t.source, 14)), t.sha256[:8], t.created[:10]))
                               for t in tasksets])
        listed = [RunReport.model_validate(r) for r in await self.client.call("GET", "/rl/runs")]
        self.runs = {str(run.id): run for run in listed}
        self.fill("runs", [(str(run.id), run_cells(run)) for run in reversed(listed)])  # newest first

    def offers(self, action: str, parameters: tuple[object, ...]) -> bool:
        run = self.runs.get(self.selected("runs") or "")
        if action == "cancel_run":
            return run is not None and run.state in CANCELLABLE
        if action in ("trajectories", "export"):  # a run's trajectories are stored when it ends
            return run is not None and run.state in FINISHED
        return True

    def show_keys(self) -> None:
        self.query_one("#tasksets-title", Label).update(self.titled("Task sets", ["episodes"]))
        self.query_one("#runs-title", Label).update(
            self.titled("RL runs", ["cancel_run", "trajectories", "export"]))
        run = self.runs.get(self.selected("runs") or "")
        self.query_one("#run", Static).update(run_line(run) if run else "")

    def action_cancel_run(self) -> None:
        run = self.selected("runs")
        if run is not None:
            self.act(lambda: self.client.call("POST", f"/rl/runs/{run}/cancel"), f"run {run}: cancel asked",
                     f"Cancel RL run {run}? (its attempts so far are kept)")

    def action_export(self) -> None:
        run = self.selected("runs")
        if run is not None:
            ask = default_ask(int(run))
            self.act(lambda: self.client.call("POST", f"/rl/runs/{run}/exports", json=ask.model_dump()),
                     f"run {run}: export asked (datasets {ask.sft} and {ask.dpo})",
                     f"Export run {run}'s SFT and DPO sets as datasets {ask.sft} and {ask.dpo}? (datasets of "
                     "those names are replaced)")

    async def action_episodes(self) -> None:
        await self.app.switch_mode("episodes")

    def action_trajectories(self) -> None:
        run = self.selected("runs")
        if run is not None:
            self.act(lambda: self._show_attempts(run), f"run {run}: trajectories read and verified")

    async def _show_attempts(self, run: str) -> None:
        listed = [Attempt.model_validate(a) for a in await self.client.call("GET", f"/rl/runs/{run}/attempts")]
        self.attempts = {a.key: a for a in listed}
        self.query_one("#attempts-title", Label).update(f"Attempts of run {run} (enter: show one)")
        self.fill("attempts", [(a.key, (shown(a.task), a.sample, a.round, a.status, f"{a.tests_passed}/{a.tests_total}",
                                        f"{a.reward:.3f}", shown(a.exit_reason[:60]))) for a in listed],
                  empty=f"Run {run} left no attempts.")

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if event.data_table.id == "attempts" and (chosen := self.attempts.get(event.row_key.value or "")):
            self.query_one("#attempt", Static).update(attempt_text(chosen))
