"""Adapters and jobs: training jobs with live progress (cancel), adapter versions with their
evaluation metrics, and deploy / canary / rollback of an adapter name, each confirmed first."""

from __future__ import annotations

import asyncio

from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Label

from appliance.adapters import AdapterMetrics, AdapterRecord, Alias, Registry
from appliance.jobs import JobReport, JobState
from tui.dialogs import Field, Form
from tui.panel import Panel, duration, fill, selected_key


def served(name: str, version: int, aliases: dict[str, Alias]) -> str:
    alias = aliases.get(name)
    if alias is None:
        return ""
    if alias.stable == version:
        return "stable"
    if alias.canary == version:
        return f"canary {alias.canary_share:.0%}"
    return ""


def eval_summary(metrics: AdapterMetrics) -> str:
    parts = [f"loss {metrics.base_eval_loss:.3f}->{metrics.adapter_eval_loss:.3f}"]
    parts += [f"{kind} {scores.base:.2f}->{scores.adapter:.2f}" for kind, scores in metrics.eval_sets.items()]
    if metrics.gate_failures:
        parts.append("gate: " + "; ".join(metrics.gate_failures))
    return ", ".join(parts)


class Training(Panel):
    REFRESH_S = 2.0
    DEFAULT_CSS = Panel.DEFAULT_CSS + """
    #jobs, #adapters { height: 1fr; }
    Label { padding: 0 1; text-style: bold; }
    """
    # Listed above each table rather than in the footer, which holds the screen keys at 80 columns.
    BINDINGS = [Binding("c", "cancel_job", "Cancel job", show=False), Binding("p", "deploy", "Deploy", show=False),
                Binding("n", "canary", "Canary", show=False), Binding("b", "rollback", "Rollback", show=False)]

    def __init__(self) -> None:
        super().__init__()
        self.records: dict[str, AdapterRecord] = {}

    def body(self) -> ComposeResult:
        yield Label("Training jobs (c: cancel)")
        yield DataTable(id="jobs", cursor_type="row")
        yield Label("Adapters (p: deploy, n: canary, b: rollback)")
        yield DataTable(id="adapters", cursor_type="row")

    def on_mount(self) -> None:
        super().on_mount()
        self.query_one("#jobs", DataTable).add_columns("job", "adapter", "state", "step", "loss", "tok/s", "ETA")
        self.query_one("#adapters", DataTable).add_columns("adapter", "v", "state", "served", "evaluation")

    async def load(self) -> None:
        job_list, answer = await asyncio.gather(self.client.call("GET", "/jobs"),
                                                self.client.call("GET", "/adapters"))
        rows = []
        for job in reversed([JobReport.model_validate(j) for j in job_list]):  # newest first
            p = job.progress
            rows.append((str(job.id), (
                job.id, job.name, job.state, f"{p.step}/{p.max_steps}" if p else "-",
                f"{p.loss:.3f}" if p and p.loss is not None else "-",
                f"{p.tokens_per_s:.0f}" if p else "-",
                duration(p.eta_s) if p and job.state == JobState.RUNNING else "-")))
        fill(self.query_one("#jobs", DataTable), rows)
        registry = Registry.model_validate(answer)
        self.records = {f"{r.name}:{r.version}": r for r in registry.adapters}
        fill(self.query_one("#adapters", DataTable),
             [(key, (r.name, r.version, r.state, served(r.name, r.version, registry.aliases), eval_summary(r.metrics)))
              for key, r in sorted(self.records.items(), key=lambda item: (item[1].name, -item[1].version))])

    def _adapter(self) -> AdapterRecord | None:
        return self.records.get(selected_key(self.query_one("#adapters", DataTable)) or "")

    def action_cancel_job(self) -> None:
        job = selected_key(self.query_one("#jobs", DataTable))
        if job is not None:
            self.act(lambda: self.client.call("POST", f"/jobs/{job}/cancel"), f"job {job}: cancel asked",
                     f"Cancel training job {job}? (its checkpoints are kept)")

    def action_deploy(self) -> None:
        if (r := self._adapter()) is not None:
            self.act(lambda: self.client.call("POST", f"/adapters/{r.name}/deploy", json={"version": r.version}),
                     f"{r.name} v{r.version} deployed",
                     f"Deploy {r.name} v{r.version}? All of {r.name!r}'s traffic moves to it.")

    def action_rollback(self) -> None:
        if (r := self._adapter()) is not None:
            self.act(lambda: self.client.call("POST", f"/adapters/{r.name}/rollback"), f"{r.name} rolled back",
                     f"Roll back {r.name!r}? (drops its canary, else returns to the version served before)")

    def action_canary(self) -> None:
        r = self._adapter()
        if r is None:
            return

        def chosen(values: dict[str, str] | None) -> None:
            if values is None:
                return
            try:
                share = float(values["share"])
            except ValueError:
                self.notify(f"share {values['share']!r} is not a number", severity="error", markup=False)
                return
            self.act(lambda: self.client.call("POST", f"/adapters/{r.name}/canary",
                                              json={"version": r.version, "share": share}),
                     f"{r.name} v{r.version} takes {share:.0%} of the traffic")

        self.app.push_screen(Form(f"Canary {r.name} v{r.version}: share of requests (0-1)",
                                  [Field("share", "share", value="0.1")]), chosen)
