"""/admin/jobs (role `admin`): training jobs, listed with their progress, and cancelled."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path

from appliance import jobs
from appliance.home import Home
from serve.audit_trail import MONITORING
from serve.deps import requires


def router(home: Home) -> APIRouter:
    routes = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(requires("admin"))])

    @routes.get("/jobs", response_model=list[jobs.JobReport], name="jobs.list", openapi_extra=MONITORING)
    def list_jobs() -> list[jobs.JobReport]:
        """Training jobs, oldest first, with their latest progress: the phase (training, evaluating in the
        gate, registering), the steps, the gate's evaluations done of sets x seeds, and the phase's ETA."""
        return [jobs.report(home, job) for job in jobs.listing(home)]

    @routes.post("/jobs/{job_id}/cancel", response_model=jobs.JobReport, name="jobs.cancel")
    def cancel_job(job_id: Annotated[int, Path(ge=1, le=2**63 - 1)]) -> jobs.JobReport:  # SQLite's integer range
        """Cancel a queued job at once, or ask its worker to stop a running one (checkpoints kept).
        No such job: 404; one that has ended: 409 (`illegal_transition`)."""
        return jobs.report(home, jobs.cancel(home, job_id))

    return routes
