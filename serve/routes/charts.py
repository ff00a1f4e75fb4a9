"""/admin/charts (role `admin`): the dashboard's key series over a recent window, as the
appliance's Prometheus holds them (the Grafana dashboard's expressions; no PromQL from clients)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query

from appliance import charts
from appliance.home import Home
from appliance.settings import Settings
from serve.audit_trail import MONITORING
from serve.deps import requires


def router(settings: Settings, home: Home) -> APIRouter:
    routes = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(requires("admin"))])

    @routes.get("/charts", response_model=list[charts.Series], name="charts.query", openapi_extra=MONITORING)
    def key_series(minutes: int = Query(charts.MINUTES, ge=1, le=24 * 60, description="The window, up to now."),
                   step_s: int = Query(charts.STEP_S, ge=1, le=3600, description="Seconds between two points "
                                       f"(at most {charts.MAX_POINTS} points a series).")) -> list[charts.Series]:
        """The key series, a point a step (409 with monitoring off, 503 if Prometheus does not answer)."""
        return charts.series(settings.monitoring, home, minutes, step_s)

    return routes
