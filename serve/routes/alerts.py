"""/admin/alerts (role `admin`): the alerts firing now, as the appliance's Alertmanager holds them."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from appliance import alerts
from appliance.home import Home
from appliance.settings import Settings
from serve.audit_trail import MONITORING
from serve.deps import requires


def router(settings: Settings, home: Home) -> APIRouter:
    routes = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(requires("admin"))])

    @routes.get("/alerts", response_model=list[alerts.Alert], name="alerts.list", openapi_extra=MONITORING)
    def firing() -> list[alerts.Alert]:
        """Firing alerts, the most urgent first (409 with monitoring off, 503 if Alertmanager does not answer)."""
        return alerts.firing(settings.monitoring, home)

    return routes
