"""/admin/services and /admin/settings (role `admin`): the supervised programs and their control,
the settings in effect (secrets masked).

Handlers are plain functions where they block (supervisord's XML-RPC): FastAPI runs them in its
thread pool.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from appliance.errors import SupervisorError
from appliance.home import Home
from appliance.settings import Settings
from appliance.supervisor import ProcessInfo, Supervisor
from serve.audit_trail import MONITORING
from serve.deps import requires
from serve.errors import GatewayError


class Service(BaseModel):
    name: str
    state: str
    pid: int
    uptime_s: int
    restarts: int = Field(0, description="Starts after the first, as supervisord's log records them.")
    log: str


def _service(info: ProcessInfo, restarts: dict[str, int]) -> Service:
    return Service(name=info.name, state=info.state.name, pid=info.pid, uptime_s=info.uptime_s,
                   restarts=max(0, restarts.get(info.name, 0)), log=str(info.log))


def router(settings: Settings, home: Home) -> APIRouter:
    routes = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(requires("admin"))])

    def process(name: str) -> ProcessInfo:
        for info in Supervisor(home).processes():
            if info.name == name:
                return info
        raise GatewayError(404, f"no service named {name!r}", code="not_found")

    @routes.get("/services", response_model=list[Service], name="services.list", openapi_extra=MONITORING)
    def services() -> list[Service]:
        """Every supervised program and its state (503 if supervisord does not answer)."""
        supervisor = Supervisor(home)
        restarts = supervisor.restarts()
        return [_service(info, restarts) for info in supervisor.processes()]

    @routes.post("/services/{name}/{action}", response_model=Service, name="services.{action}")
    def control(name: str, action: Literal["start", "stop", "restart"]) -> Service:
        """Start, stop or restart one supervised program (not the gateway itself)."""
        process(name)
        if name == "gateway":
            raise GatewayError(409, "the gateway cannot stop itself; use `appliance down`", code="conflict")
        supervisor = Supervisor(home)
        try:
            if action in ("stop", "restart") and process(name).state.name in ("RUNNING", "STARTING"):
                supervisor.call("stopProcess", name, True)
            if action in ("start", "restart"):
                supervisor.call("startProcess", name, False)
        except SupervisorError as exc:  # supervisord refused the move (e.g. already starting)
            raise GatewayError(409, exc.message, code="conflict") from exc
        return _service(process(name), supervisor.restarts())

    @routes.get("/settings", name="settings.read")
    def effective_settings() -> dict[str, Any]:
        """The settings in effect, secrets masked."""
        return settings.masked()

    return routes
