"""Adapters and jobs: training jobs with live progress (cancel), adapter versions with their
evaluation metrics, and deploy / canary / rollback of an adapter name, each confirmed first and
offered only on a row it applies to."""

from __future__ import annotations

import asyncio
from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Label

from appliance.adapters import AdapterMetrics, AdapterRecord, AdapterState, Alias, Registry
from appliance.admin_client import Refused
from appliance.jobs import JobReport, JobState, Phase, Progress, hosts_line, memory_line
from tui.dialogs import Field, Form
from tui.panel import Panel, duration


def served(name: str, version: int, aliases: dict[str, Alias],
           analyses: dict[str, dict[str, Any]] | None = None) -> str:
    alias = aliases.get(name)
    if alias is None:
        return ""
    if alias.stable == version:
        return "stable"
    if alias.canary == version:
        shown = f"canary {alias.canary_share:.0%}"
        if alias.canary_analysis is not None:
            shown += ", " + canary_summary(alias.canary_analysis.windows, (analyses or {}).get(name))
        return shown
    return ""


def canary_summary(windows: int, status: dict[str, Any] | None) -> str:
    """A canary's analysis as it runs: windows passed, then each figure of this window, canary vs stable."""
    if status is None:
        return "judging starts"
    canary, stable = status["canary_figures"], status["stable_figures"]
    parts = [f"judged {status['passed_windows']}/{windows}", f"answers {canary['requests']} vs {stable['requests']}"]
    for key, label, form in (("error_rate", "errors", "{:.0%}"), ("latency_p50_s", "p50", "{:.2f} s"),
                             ("success_rate", "success", "{:.0%}"), ("satisfaction", "satisfied", "{:.1f}")):
        if canary.get(key) is not None and stable.get(key) is not None:
            parts.append(f"{label} {form.format(canary[key])} vs {form.format(stable[key])}")
    return ", ".join(parts)


def eval_summary(metrics: AdapterMetrics) -> str:
    parts = [f"loss {metrics.base_eval_loss:.3f}->{metrics.adapter_eval_loss:.3f}"]
    parts += [scores.line(kind) for kind, scores in metrics.eval_sets.items()]
    if metrics.gate_failures:
        parts.append("gate: " + "; ".join(metrics.gate_failures))
    return ", ".join(parts)


def phase_progress(p: Progress | None, *, running: bool) -> str:
    """A job's phase and how far into it, short: its steps while it trains, its evaluations (sets x
    seeds) while the gate evaluates, then registering; once it has ended, the steps it trained."""
    if p is None:
        return "-"
    if not running or p.phase == Phase.TRAINING:
        return f"step {p.step}/{p.max_steps}"
    if p.phase == Phase.EVALUATING:
        return f"gate {p.evaluations}/{p.evaluations_total}" if p.evaluations_total else "gate"
    return "registering"


CANCELLABLE = (JobState.QUEUED, JobState.RUNNING)
DEPLOYABLE = (AdapterState.REGISTERED, AdapterState.CANARY)


def rollback_question(name: str, alias: Alias) -> str:
    """What rolling back `name` does, said before it is done."""
    if alias.canary is not None:
        return f"Roll back {name!r}: drop its canary v{alias.canary}?"
    if not alias.history:
        return f"Roll back {name!r} from v{alias.stable} to no version (its requests refused until a deploy)?"
    return f"Roll back {name!r} from v{alias.stable} to v{alias.history[-1]}?"


class Training(Panel):
    REFRESH_S = 2.0
    DEFAULT_CSS = Panel.DEFAULT_CSS + """
    #jobs, #adapters { height: 1fr; }
    Label { padding: 0 1; text-style: bold; }
    """
    # Listed above each table rather than in the footer, which holds the screen keys at 80 columns.
    BINDINGS = [Binding("c", "cancel_job", "cancel", show=False), Binding("p", "deploy", "deploy", show=False),
                Binding("n", "canary", "canary", show=False), Binding("b", "rollback", "rollback", show=False),
                Binding("r", "retire", "retire", show=False)]
    EMPTY = {"jobs": "No training jobs yet: queue one with `appliance finetune submit --data DATASET --name "
                     "ADAPTER` (store the dataset first with `appliance data add`).",
             "adapters": "No adapters yet: train one with `appliance finetune submit`; each version it "
                         "registers shows here, to deploy or try as a canary."}

    def __init__(self) -> None:
        super().__init__()
        self.job_states: dict[str, JobState] = {}
        self.records: dict[str, AdapterRecord] = {}
        self.aliases: dict[str, Alias] = {}

    def body(self) -> ComposeResult:
        yield Label("Training jobs", id="jobs-title")
        yield from self.listing("jobs")
        yield Label("Adapters", id="adapters-title")
        yield from self.listing("adapters")

    def on_mount(self) -> None:
        self.query_one("#jobs", DataTable).add_columns("job", "adapter", "state", "progress", "loss", "tok/s", "ETA")
        self.query_one("#adapters", DataTable).add_columns("adapter", "v", "state", "served", "evaluation")

    async def load(self) -> None:
        job_list, answer = await asyncio.gather(self.client.call("GET", "/jobs"),
                                                self.client.call("GET", "/adapters"))
        registry = Registry.model_validate(answer)
        judged = [name for name, alias in registry.aliases.items() if alias.canary_analysis is not None]
        statuses = await asyncio.gather(*(self._analysis(name) for name in judged))
        self._show_jobs([JobReport.model_validate(j) for j in job_list])
        self._show_adapters(registry, {name: status for name, status in zip(judged, statuses, strict=True)
                                       if status is not None})

    async def _analysis(self, name: str) -> dict[str, Any] | None:
        """A canary's analysis as it runs; None when it has none (ended since the list was read)."""
        try:
            status: dict[str, Any] = await self.client.call("GET", f"/adapters/{name}/canary")
        except Refused as exc:
            if exc.status == 404:
                return None
            raise
        window: dict[str, Any] | None = status["analysis"]
        return window

    def _show_jobs(self, listed: list[JobReport]) -> None:
        self.job_states = {str(job.id): job.state for job in listed}
        rows = []
        for job in reversed(listed):  # newest first
            p = job.progress
            progress = phase_progress(p, running=job.state == JobState.RUNNING)
            what = (progress, memory_line(job.ranks, job.estimated_process_bytes), hosts_line(job.hosts))
            rows.append((str(job.id), (
                job.id, job.name, job.state, "; ".join(part for part in what if part),
                f"{p.loss:.3f}" if p and p.loss is not None else "-",
                f"{p.tokens_per_s:.0f}" if p else "-",
                duration(p.eta_s) if p and p.eta_s is not None and job.state == JobState.RUNNING else "-")))
        self.fill("jobs", rows)

    def _show_adapters(self, registry: Registry, analyses: dict[str, dict[str, Any]]) -> None:
        self.records = {f"{r.name}:{r.version}": r for r in registry.adapters}
        self.aliases = registry.aliases
        self.fill("adapters", [
            (key, (r.name, r.version, r.state, served(r.name, r.version, registry.aliases, analyses),
                   eval_summary(r.metrics)))
            for key, r in sorted(self.records.items(), key=lambda item: (item[1].name, -item[1].version))])

    def _adapter(self) -> AdapterRecord | None:
        return self.records.get(self.selected("adapters") or "")

    def offers(self, action: str, parameters: tuple[object, ...]) -> bool:
        if action == "cancel_job":
            return self.job_states.get(self.selected("jobs") or "") in CANCELLABLE
        if action not in ("deploy", "canary", "rollback", "retire"):
            return True
        r = self._adapter()
        if r is None:
            return False
        alias = self.aliases.get(r.name)
        if action == "deploy":
            return r.state in DEPLOYABLE
        if action == "canary":  # beside the stable version of a name already served
            return r.state == AdapterState.REGISTERED and alias is not None
        if action == "retire":  # a version not served (the registry refuses the others)
            return r.state != AdapterState.RETIRED and (alias is None or r.version not in (alias.stable, alias.canary))
        # on the version a rollback takes out of service: the canary if there is one, else the stable
        return alias is not None and r.version == (alias.canary if alias.canary is not None else alias.stable)

    def show_keys(self) -> None:
        self.query_one("#jobs-title", Label).update(self.titled("Training jobs", ["cancel_job"]))
        self.query_one("#adapters-title", Label).update(self.titled("Adapters", ["deploy", "canary", "rollback",
                                                                                       "retire"]))

    def action_cancel_job(self) -> None:
        job = self.selected("jobs")
        if job is not None:
            self.act(lambda: self.client.call("POST", f"/jobs/{job}/cancel"), f"job {job}: cancel asked",
                     f"Cancel training job {job}? (its checkpoints are kept)")

    def action_deploy(self) -> None:
        if (r := self._adapter()) is not None:
            self.act(lambda: self.client.call("POST", f"/adapters/{r.name}/deploy", json={"version": r.version}),
                     f"{r.name} v{r.version} deployed",
                     f"Deploy {r.name} v{r.version}? All of {r.name!r}'s traffic moves to it.")

    def action_rollback(self) -> None:
        r = self._adapter()
        if r is not None and (alias := self.aliases.get(r.name)) is not None:
            self.act(lambda: self.client.call("POST", f"/adapters/{r.name}/rollback"), f"{r.name} rolled back",
                     rollback_question(r.name, alias))

    def action_retire(self) -> None:
        if (r := self._adapter()) is not None:
            self.act(lambda: self.client.call("POST", f"/adapters/{r.name}/retire", json={"version": r.version}),
                     f"{r.name} v{r.version} retired",
                     f"Retire {r.name} v{r.version}? It can never be deployed again.")

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
