"""/admin/system (role `admin`): the host's CPU, memory and GPU usage, now."""

from __future__ import annotations

import anyio
from fastapi import APIRouter, Depends

from appliance.settings import Settings
from appliance.usage import HostUsage, host_usage
from serve.audit_trail import MONITORING
from serve.deps import requires


def router(settings: Settings) -> APIRouter:
    routes = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(requires("admin"))])

    @routes.get("/system", response_model=HostUsage, name="system.read", openapi_extra=MONITORING)
    async def system() -> HostUsage:
        """CPU, memory and each GPU's utilisation, memory, temperature, power, memory errors and
        slowdowns (NVML), now."""
        return await anyio.to_thread.run_sync(host_usage, settings.monitoring.nvml_library)

    return routes
