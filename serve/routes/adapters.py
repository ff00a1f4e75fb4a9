"""/admin/adapters (role `admin`): LoRA adapter versions and what each name serves; deploy, canary,
rollback and retire through the gateway's AdapterRoutes (the states they move are checked by
appliance.adapters)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from appliance.adapters import AdapterRecord, Alias, Registry
from appliance.canary import CanaryAnalysis
from appliance.roles import Role
from serve.adapters import AdapterRoutes
from serve.audit_trail import MONITORING, note_target
from serve.deps import requires


class DeployRequest(BaseModel):
    version: int | None = Field(None, ge=1, description="Unset: the newest version that passed its gate.")
    pool: str | None = Field(None, description="Engine pool (unset: where the name is served now, else the first).")
    roles: list[Role] | None = Field(
        None, min_length=1, description="Roles that may call it (unset: as before, else user and admin).")


class CanaryRequest(BaseModel):
    version: int = Field(ge=1)
    share: float = Field(gt=0, lt=1, description="Fraction of the name's requests sent to this version.")
    analysis: CanaryAnalysis | None = Field(None, description="Judge the canary against the stable version window "
                                            "by window, and promote or abort it by itself (unset: by hand).")


class RetireRequest(BaseModel):
    version: int | None = Field(None, ge=1, description="Unset: every version, and the name is no longer served.")


def _adapters(request: Request) -> AdapterRoutes:
    adapters: AdapterRoutes = request.app.state.gateway.adapters
    return adapters


def router() -> APIRouter:
    routes = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(requires("admin"))])

    @routes.get("/adapters", response_model=Registry, name="adapters.list", openapi_extra=MONITORING)
    def list_adapters(request: Request) -> Registry:
        """Every adapter version with its metrics and state, and what each name serves."""
        return _adapters(request).registry()

    @routes.post("/adapters/{name}/deploy", response_model=Alias, name="adapters.deploy")
    async def deploy_adapter(request: Request, name: str, deploy: DeployRequest) -> Alias:
        """Load a version into its pool's engine (no restart) and serve it under `name`."""
        note_target(request, "adapter", name, version=deploy.version)
        alias = await _adapters(request).deploy(name, deploy.version, deploy.pool, deploy.roles)
        note_target(request, "adapter", name, version=alias.stable)
        return alias

    @routes.post("/adapters/{name}/canary", response_model=Alias, name="adapters.canary")
    async def canary_adapter(request: Request, name: str, canary: CanaryRequest) -> Alias:
        """Send a share of `name`'s requests to another version."""
        note_target(request, "adapter", name, version=canary.version)
        return await _adapters(request).canary(name, canary.version, canary.share, canary.analysis)

    @routes.get("/adapters/{name}/canary", name="adapters.canary.read", openapi_extra=MONITORING)
    def canary_status(request: Request, name: str) -> dict[str, object]:
        """`name`'s canary as it runs: the two versions and the canary's share; when it is judged,
        both versions' figures in the current window and the passing windows before it (`analysis`,
        null when it is not). 404 when the name has no canary."""
        return _adapters(request).canary_status(name)

    @routes.post("/adapters/{name}/rollback", response_model=Alias, name="adapters.rollback")
    async def rollback_adapter(request: Request, name: str) -> Alias:
        """Drop the canary; without one, serve the version served before (past the first: none,
        and requests for the name are refused until a version is deployed)."""
        alias = await _adapters(request).rollback(name)
        note_target(request, "adapter", name, version=alias.stable)  # what it serves now (None: nothing)
        return alias

    @routes.post("/adapters/{name}/retire", response_model=list[AdapterRecord], name="adapters.retire")
    async def retire_adapter(request: Request, name: str, retire: RetireRequest) -> list[AdapterRecord]:
        """Retire a version that is not served, or the whole name."""
        note_target(request, "adapter", name, version=retire.version)
        return await _adapters(request).retire(name, retire.version)

    return routes
