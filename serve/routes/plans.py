"""/admin/plans (role `admin`): each pool's plan and the staging state of its weights."""

from __future__ import annotations

import pathlib

from fastapi import APIRouter, Depends
from pydantic import BaseModel

from appliance.errors import ApplianceError
from appliance.home import Home
from appliance.model_refs import model_dir
from appliance.records import STAGING_MANIFEST, Plan, load_plan
from appliance.settings import Settings
from appliance.staging_manifest import StagingManifest
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

    return routes
