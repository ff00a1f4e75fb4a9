"""The gateway's admin API, one module per resource (its routes with their request and response
models), and `admin_routers`, which the gateway includes. Every route declares its audit action as
its name."""

from __future__ import annotations

from fastapi import APIRouter

from appliance.home import Home
from appliance.settings import Settings
from serve.routes import (
    adapters,
    alerts,
    audit,
    batches,
    charts,
    jobs,
    keys,
    plans,
    rl,
    services,
    serving,
    system,
    users,
)


def admin_routers(settings: Settings, home: Home) -> list[APIRouter]:
    return [services.router(settings, home), users.router(settings, home), adapters.router(),
            audit.router(home), system.router(settings), plans.router(settings, home), jobs.router(home),
            rl.router(settings, home), serving.router(home),
            batches.router(settings, home), keys.router(settings, home), alerts.router(settings, home),
            charts.router(settings, home)]
