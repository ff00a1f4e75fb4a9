"""The gateway's routes, one module per resource (its routes with their request and response
models): the admin API, gathered by `admin_routers`, and beside it the OpenAI routes the gateway
serves itself (v1) and health and metrics (health), which the gateway includes first. Every audited
route declares its audit action as its name."""

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
    datasets,
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
            charts.router(settings, home), datasets.router(settings, home)]
