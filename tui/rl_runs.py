"""Post-training from execution feedback: the task sets, RL runs with their live figures (pass
rate, rewards, sandbox queue depth and workers; cancel, export of their SFT and DPO sets), and a
finished run's trajectories: its attempts, and one attempt's code with the error fed back for its
correction."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Label, Static

from appliance.jobs import JobState
from appliance.rl.attempts import Attempt
from appliance.rl.exports import default_ask
from appliance.rl.progress import RunReport
from appliance.rl.tasks import TaskSet
from appliance.terminal import shown
from tui.panel import Panel, fill, selected_key


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


class RlRuns(Panel):
    REFRESH_S = 2.0
    DEFAULT_CSS = Panel.DEFAULT_CSS + """
    #tasksets { height: auto; max-height: 6; }
    #runs { height: 1fr; }
    #attempts { height: 1fr; }
    #attempt { height: auto; max-height: 16; overflow-y: auto; padding: 0 1; }
    Label { padding: 0 1; text-style: bold; }
    """
    BINDINGS = [Binding("c", "cancel_run", "Cancel run", show=False),
                Binding("t", "trajectories", "Trajectories", show=False),
                Binding("x", "export", "Export SFT/DPO sets", show=False)]

    def __init__(self) -> None:
        super().__init__()
        self.attempts: dict[str, Attempt] = {}

    def body(self) -> ComposeResult:
        yield Label("Task sets")
        yield DataTable(id="tasksets", cursor_type="row")
        yield Label("RL runs (c: cancel, t: trajectories, x: export its SFT and DPO sets as datasets)")
        yield DataTable(id="runs", cursor_type="row")
        yield Label("Attempts (enter: show one)")
        yield DataTable(id="attempts", cursor_type="row")
        yield Static("", id="attempt", markup=False)

    def on_mount(self) -> None:
        super().on_mount()
        self.query_one("#tasksets", DataTable).add_columns("name", "tasks", "train", "held out", "source",
                                                         "sha256", "added")
        self.query_one("#runs", DataTable).add_columns("run", "model", "tasks", "state", "attempts", "pass rate",
                                                     "first", "reward", "queue", "workers")
        self.query_one("#attempts", DataTable).add_columns("task", "sample", "round", "status", "tests", "reward",
                                                         "why")

    async def load(self) -> None:
        tasksets = [TaskSet.model_validate(t) for t in await self.client.call("GET", "/rl/tasksets")]
        fill(self.query_one("#tasksets", DataTable),
             [(t.name, (shown(t.name), t.tasks, t.train, t.held_out, shown(t.source), t.sha256[:12], t.created))
              for t in tasksets])
        rows = []
        for run in reversed([RunReport.model_validate(r) for r in await self.client.call("GET", "/rl/runs")]):
            p = run.progress
            rows.append((str(run.id), (
                run.id, shown(run.spec.adapter or run.spec.base), run.spec.tasks, run.state,
                f"{p.attempts_done}/{p.attempts_planned}" if p else "-", f"{p.pass_rate:.0%}" if p else "-",
                f"{p.first_pass_rate:.0%}" if p else "-", f"{p.mean_reward:.3f}" if p else "-",
                p.queue_depth if p else "-", p.workers if p and run.state == JobState.RUNNING else "-")))
        fill(self.query_one("#runs", DataTable), rows)

    def action_cancel_run(self) -> None:
        run = selected_key(self.query_one("#runs", DataTable))
        if run is not None:
            self.act(lambda: self.client.call("POST", f"/rl/runs/{run}/cancel"), f"run {run}: cancel asked",
                     f"Cancel RL run {run}? (its attempts so far are kept)")

    def action_export(self) -> None:
        run = selected_key(self.query_one("#runs", DataTable))
        if run is not None:
            ask = default_ask(int(run))
            self.act(lambda: self.client.call("POST", f"/rl/runs/{run}/exports", json=ask.model_dump()),
                     f"run {run}: export asked (datasets {ask.sft} and {ask.dpo})",
                     f"Export run {run}'s SFT and DPO sets as datasets {ask.sft} and {ask.dpo}? (datasets of "
                     "those names are replaced)")

    def action_trajectories(self) -> None:
        run = selected_key(self.query_one("#runs", DataTable))
        if run is not None:
            self.act(lambda: self._show_attempts(run), f"run {run}: trajectories read and verified")

    async def _show_attempts(self, run: str) -> None:
        listed = [Attempt.model_validate(a) for a in await self.client.call("GET", f"/rl/runs/{run}/attempts")]
        self.attempts = {a.key: a for a in listed}
        fill(self.query_one("#attempts", DataTable),
             [(a.key, (shown(a.task), a.sample, a.round, a.status, f"{a.tests_passed}/{a.tests_total}",
                       f"{a.reward:.3f}", shown(a.exit_reason[:60]))) for a in listed])

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if event.data_table.id == "attempts" and (chosen := self.attempts.get(event.row_key.value or "")):
            self.query_one("#attempt", Static).update(attempt_text(chosen))
