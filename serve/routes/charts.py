"""/admin/charts (role `admin`): the dashboard's key series over a recent window, as the
appliance's Prometheus holds them (the Grafana dashboard's expressions; no PromQL from clients)."""

from __future__ import annotations

import time

import anyio
from fastapi import APIRouter, Depends, Query

from appliance import charts
from appliance.home import Home
from appliance.settings import Settings
from serve.audit_trail import MONITORING
from serve.deps import requires


def router(settings: Settings, home: Home) -> APIRouter:
    routes = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(requires("admin"))])
    # One query of Prometheus at a time, in a thread of its own: however many dashboards refresh (or
    # however slow Prometheus is), charts hold one thread, never the pool the rest of the gateway
    # works in. Callers asking the same window while one is read share its answer.
    one_at_a_time, thread = anyio.Lock(), anyio.CapacityLimiter(1)
    answered: dict[tuple[int, int, int], list[charts.Series]] = {}

    @routes.get("/charts", response_model=list[charts.Series], name="charts.query", openapi_extra=MONITORING)
    async def key_series(minutes: int = Query(charts.MINUTES, ge=1, le=24 * 60, description="The window, up to "
                                              "now."),
                         step_s: int = Query(charts.STEP_S, ge=1, le=3600, description="Seconds between two points "
                                             f"(at most {charts.MAX_POINTS} points a series).")
                         ) -> list[charts.Series]:
        """The key series, a point a step (409 with monitoring off, 503 if Prometheus does not answer)."""
        async with one_at_a_time:
            key = (minutes, step_s, int(time.time()) // step_s)
            if key not in answered:
                found = await anyio.to_thread.run_sync(charts.series, settings.monitoring, home, minutes, step_s,
                                                       limiter=thread)
                answered.clear()  # only the latest window is kept
                answered[key] = found
            return answered[key]

    return routes
