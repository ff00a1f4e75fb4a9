"""Admin routes for watching and steering the running appliance (role `admin`): host usage,
each pool's plan and staging state, training jobs (list with progress, cancel), and RL task sets
and runs (list with live figures, cancel, a finished run's attempts)."""

from __future__ import annotations

import pathlib
from typing import Annotated

import anyio
from fastapi import APIRouter, Depends, Path, Query, Response
from pydantic import BaseModel

from appliance import jobs, rl, trajectories
from appliance.artifacts import artifact_store
from appliance.errors import ApplianceError
from appliance.home import Home
from appliance.model_refs import model_dir
from appliance.records import STAGING_MANIFEST, Plan, load_plan
from appliance.settings import Settings
from appliance.staging_manifest import StagingManifest
from appliance.usage import HostUsage, host_usage
from serve.audit_trail import MONITORING
from serve.deps import requires


class Staging(BaseModel):
    """What `appliance stage` left in a pool's model directory."""

    directory: str
    format: str
    host: str
    complete: bool
    files: int
    bytes: int


class PoolPlan(BaseModel):
    pool: str
    model_dir: str
    plan_file: str | None
    plan: Plan | None
    plan_error: str | None = None
    staging: Staging | None


def staging_of(directory: pathlib.Path) -> Staging | None:
    """The staging manifest's summary, if `directory` was staged (None for a plain checkpoint)."""
    if not (directory / STAGING_MANIFEST).exists():
        return None
    manifest = StagingManifest.load(directory)  # damaged: StateError, a 503 naming the file
    files = manifest.staged_files()
    return Staging(directory=str(directory), format=manifest.format, host=manifest.host,
                   complete=manifest.complete, files=len(files), bytes=manifest.total_bytes())



def router(settings: Settings, home: Home) -> APIRouter:
    routes = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(requires("admin"))])

    @routes.get("/system", response_model=HostUsage, name="system.read", openapi_extra=MONITORING)
    async def system() -> HostUsage:
        """CPU, memory and each GPU's utilisation, memory and temperature (NVML), now."""
        return await anyio.to_thread.run_sync(host_usage)

    @routes.get("/plans", response_model=list[PoolPlan], name="plans.list", openapi_extra=MONITORING)
    def plans() -> list[PoolPlan]:
        """Each pool's plan (per-GPU memory, rejected alternatives) and its weights' staging state."""
        views = []
        for pool in settings.pools:
            plan, error = None, None
            if pool.plan:
                try:
                    plan = load_plan(pathlib.Path(pool.plan), f"pools.{pool.name}.plan")
                except ApplianceError as exc:
                    error = exc.one_line()
            directory = model_dir(pool, home)
            views.append(PoolPlan(pool=pool.name, model_dir=str(directory), plan_file=pool.plan, plan=plan,
                                  plan_error=error, staging=staging_of(directory)))
        return views

    @routes.get("/jobs", response_model=list[jobs.JobReport], name="jobs.list", openapi_extra=MONITORING)
    def list_jobs() -> list[jobs.JobReport]:
        """Training jobs, oldest first, with the trainer's latest progress."""
        return [jobs.report(home, job) for job in jobs.listing(home)]

    @routes.post("/jobs/{job_id}/cancel", response_model=jobs.JobReport, name="jobs.cancel")
    def cancel_job(job_id: Annotated[int, Path(ge=1, le=2**63 - 1)]) -> jobs.JobReport:  # SQLite's integer range
        """Cancel a queued job at once, or ask its worker to stop a running one (checkpoints kept).
        No such job: 404; one that has ended: 409 (`illegal_transition`)."""
        return jobs.report(home, jobs.cancel(home, job_id))

    @routes.get("/rl/tasksets", response_model=list[rl.TaskSet], name="rl.tasksets.list", openapi_extra=MONITORING)
    def list_tasksets() -> list[rl.TaskSet]:
        """Task sets for post-training from execution feedback."""
        return list(rl.load_tasksets(home).values())

    @routes.get("/rl/runs", response_model=list[rl.RunReport], name="rl.runs.list", openapi_extra=MONITORING)
    def list_runs() -> list[rl.RunReport]:
        """RL runs, oldest first, with live figures (pass rate, rewards, sandbox queue and workers)."""
        return [rl.report(home, run) for run in rl.listing(home)]

    @routes.post("/rl/runs/{run_id}/cancel", response_model=rl.RunReport, name="rl.runs.cancel")
    def cancel_run(run_id: Annotated[int, Path(ge=1, le=2**63 - 1)]) -> rl.RunReport:
        """Cancel a queued run at once, or ask its worker to stop a running one (attempts kept).
        No such run: 404; one that has ended: 409 (`illegal_transition`)."""
        return rl.report(home, rl.cancel(home, run_id))

    @routes.post("/rl/runs/{run_id}/exports", response_model=rl.Export, status_code=202, name="rl.exports.create")
    def ask_export(run_id: Annotated[int, Path(ge=1, le=2**63 - 1)], ask: rl.ExportAsk,
                   response: Response) -> rl.Export:
        """Ask the rl-worker to make the SFT set and/or the preference set of a run that ended, as
        training datasets (attempts at held-out tasks left out); its `Location` follows it. No such
        run: 404; one still running, without trajectories, or with an export unfinished: 409."""
        export = rl.ask_export(home, run_id, ask)
        response.headers["Location"] = f"/admin/rl/exports/{export.id}"
        return export

    @routes.get("/rl/exports/{export_id}", response_model=rl.Export, name="rl.exports.read",
                openapi_extra=MONITORING)
    def read_export(export_id: Annotated[int, Path(ge=1, le=2**63 - 1)]) -> rl.Export:
        """One export: queued, running, or what it stored (or why it failed). No such export: 404."""
        return rl.get_export(home, export_id)

    @routes.get("/rl/exports", response_model=list[rl.Export], name="rl.exports.list", openapi_extra=MONITORING)
    def list_exports() -> list[rl.Export]:
        """Exports asked, oldest first: queued, running, or what each stored (or why it failed)."""
        return rl.exports(home)

    # Each read recorded (not summarised as monitoring): attempts hold prompts and generated code.
    @routes.get("/rl/runs/{run_id}/attempts", response_model=list[rl.Attempt], name="rl.attempts.list")
    def run_attempts(run_id: Annotated[int, Path(ge=1, le=2**63 - 1)],
                     task: Annotated[str | None, Query(max_length=200)] = None) -> list[rl.Attempt]:
        """A finished run's attempts from its trajectories in the artifact store, every segment checked
        against its digest (a changed one: 409 `artifact_integrity`); `task` picks one task's attempts."""
        _, attempts = trajectories.read_run(artifact_store(settings.artifacts, home), home, run_id)
        return [attempt for attempt in attempts if task is None or attempt.task == task]

    return routes
