"""The admin API under /admin (role `admin`): services under supervisord, effective settings with
secrets masked, engine pools, users and roles through Keycloak's admin API, and LoRA adapters
(deploy, canary, rollback, retire).

Handlers are plain functions: FastAPI runs them in its thread pool, since the supervisor
(XML-RPC) and Keycloak admin clients block.
"""

from __future__ import annotations

import itertools
from typing import Literal

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, Field

from appliance.adapters import AdapterRecord, Alias, Registry
from appliance.errors import StateError, SupervisorError
from appliance.home import Home
from appliance.settings import Settings
from appliance.supervisor import ProcessInfo, Supervisor
from appliance.users import CreatedUser, NewUser, Role, User, Users
from audit import AuditVerificationError, read_records, verification_key, verify
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


class Pool(BaseModel):
    name: str
    model: str
    url: str
    healthy: bool


class RoleGrant(BaseModel):
    role: Role


class ChainCheck(BaseModel):
    """The result of verifying the audit log's chain and signed checkpoints."""

    ok: bool
    records: int = 0
    checkpoints: int = 0
    last_checkpoint_seq: int = 0
    where: str | None = Field(None, description="The first bad record or checkpoint (file:line (seq)).")
    reason: str | None = None


class DeployRequest(BaseModel):
    version: int | None = Field(None, ge=1, description="Unset: the newest version that passed its gate.")
    pool: str | None = Field(None, description="Engine pool (unset: where the name is served now, else the first).")
    roles: list[Role] | None = Field(
        None, min_length=1, description="Roles that may call it (unset: as before, else user and admin).")


class CanaryRequest(BaseModel):
    version: int = Field(ge=1)
    share: float = Field(gt=0, lt=1, description="Fraction of the name's requests sent to this version.")


class RetireRequest(BaseModel):
    version: int | None = Field(None, ge=1, description="Unset: every version, and the name is no longer served.")


class Admin:
    """What the admin routes act on."""

    def __init__(self, settings: Settings, home: Home) -> None:
        self.settings = settings
        self.home = home

    def supervisor(self) -> Supervisor:
        return Supervisor(self.home)

    def users(self) -> Users:
        return Users(self.settings, self.home)


def _service(info: ProcessInfo, restarts: dict[str, int]) -> Service:
    return Service(name=info.name, state=info.state.name, pid=info.pid, uptime_s=info.uptime_s,
                   restarts=max(0, restarts.get(info.name, 0)), log=str(info.log))


def admin_router(admin: Admin) -> APIRouter:
    """Routes under /admin; every one requires a valid token with role `admin`."""
    router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(requires("admin"))])

    def process(name: str) -> ProcessInfo:
        for info in admin.supervisor().processes():
            if info.name == name:
                return info
        raise GatewayError(404, f"no service named {name!r}", code="not_found")

    @router.get("/services", response_model=list[Service], name="services.list", openapi_extra=MONITORING)
    def services() -> list[Service]:
        """Every supervised program and its state (503 if supervisord does not answer)."""
        supervisor = admin.supervisor()
        restarts = supervisor.restarts()
        return [_service(info, restarts) for info in supervisor.processes()]

    @router.post("/services/{name}/{action}", response_model=Service, name="services.{action}")
    def control(name: str, action: Literal["start", "stop", "restart"]) -> Service:
        """Start, stop or restart one supervised program (not the gateway itself)."""
        process(name)
        if name == "gateway":
            raise GatewayError(409, "the gateway cannot stop itself; use `appliance down`", code="conflict")
        supervisor = admin.supervisor()
        try:
            if action in ("stop", "restart") and process(name).state.name in ("RUNNING", "STARTING"):
                supervisor.call("stopProcess", name, True)
            if action in ("start", "restart"):
                supervisor.call("startProcess", name, False)
        except SupervisorError as exc:
            raise GatewayError(409, exc.message, code="conflict") from exc
        return _service(process(name), supervisor.restarts())

    @router.get("/settings", name="settings.read")
    def settings() -> dict:
        """The settings in effect, secrets masked."""
        return admin.settings.masked()

    @router.get("/pools", response_model=list[Pool], name="pools.list", openapi_extra=MONITORING)
    async def pools(request: Request) -> list[Pool]:
        """Engine pools, the model each serves, and whether it answers."""
        upstreams = request.app.state.gateway.upstreams
        return [Pool(name=p.name, model=p.model, url=f"unix:{p.socket}", healthy=await upstreams.healthy(p))
                for p in upstreams.pools]

    @router.get("/roles", response_model=list[Role], name="roles.list")
    def roles() -> list[Role]:
        """The realm roles the appliance uses."""
        return list(Role)

    @router.get("/users", response_model=list[User], name="users.list")
    def users() -> list[User]:
        """Users of the realm with their appliance roles."""
        return admin.users().listing()

    @router.post("/users", response_model=CreatedUser, status_code=201, name="users.add")
    def add_user(new: NewUser) -> CreatedUser:
        """Create an enabled user with roles; without a password, one is generated and returned once."""
        return admin.users().add(new)

    @router.post("/users/{username}/disable", response_model=User, name="users.disable")
    def disable_user(username: str) -> User:
        """Disable a user: new logins fail; live tokens stop within the introspection interval."""
        return admin.users().disable(username)

    @router.post("/users/{username}/roles", response_model=User, name="users.grant_role")
    def grant_role(username: str, grant: RoleGrant) -> User:
        """Grant a user one more realm role (granting one it holds changes nothing)."""
        return admin.users().grant(username, grant.role)

    @router.get("/adapters", response_model=Registry, name="adapters.list", openapi_extra=MONITORING)
    def list_adapters(request: Request) -> Registry:
        """Every adapter version with its metrics and state, and what each name serves."""
        return request.app.state.gateway.adapters.registry()

    @router.post("/adapters/{name}/deploy", response_model=Alias, name="adapters.deploy")
    async def deploy_adapter(request: Request, name: str, deploy: DeployRequest) -> Alias:
        """Load a version into its pool's engine (no restart) and serve it under `name`."""
        return await request.app.state.gateway.adapters.deploy(name, deploy.version, deploy.pool, deploy.roles)

    @router.post("/adapters/{name}/canary", response_model=Alias, name="adapters.canary")
    async def canary_adapter(request: Request, name: str, canary: CanaryRequest) -> Alias:
        """Send a share of `name`'s requests to another version."""
        return await request.app.state.gateway.adapters.canary(name, canary.version, canary.share)

    @router.post("/adapters/{name}/rollback", response_model=Alias, name="adapters.rollback")
    async def rollback_adapter(request: Request, name: str) -> Alias:
        """Drop the canary; without one, serve the version served before (or the base model)."""
        return await request.app.state.gateway.adapters.rollback(name)

    @router.post("/adapters/{name}/retire", response_model=list[AdapterRecord], name="adapters.retire")
    async def retire_adapter(request: Request, name: str, retire: RetireRequest) -> list[AdapterRecord]:
        """Retire a version that is not served, or the whole name."""
        return await request.app.state.gateway.adapters.retire(name, retire.version)

    return router


def audit_router(home: Home) -> APIRouter:
    """Query and verify the audit log (role `auditor` or `admin`)."""
    router = APIRouter(prefix="/admin", tags=["audit"], dependencies=[Depends(requires("auditor", "admin"))])

    @router.get("/audit", response_model=list[dict], name="audit.query")
    def audit_records(since: str | None = None, until: str | None = None, user: str | None = None,
                      action: str | None = Query(None, description="Exact action, e.g. users.add."),
                      outcome: Literal["allowed", "denied", "error"] | None = None,
                      newest: bool = Query(False, description="The newest `limit` records, newest first."),
                      limit: int = Query(1000, ge=1, le=10_000)) -> list[dict]:
        """Audit records, oldest first (or newest first), filtered by UTC time range [since, until),
        username, action and outcome. Reading stops when the page is full (newest first reads
        the log backwards from its end)."""
        found = (record for record in read_records(home.audit, since=since, until=until, user=user,
                                                   newest_first=newest)
                 if (action is None or record.get("action") == action)
                 and (outcome is None or record.get("outcome") == outcome))
        return list(itertools.islice(found, limit))

    @router.post("/audit/verify", response_model=ChainCheck, name="audit.verify")
    def verify_chain() -> ChainCheck:
        """Verify every record's hash, the chain, the sequence and every checkpoint's signature."""
        try:
            summary = verify(home.audit, verification_key(home))
        except AuditVerificationError as exc:
            return ChainCheck(ok=False, where=exc.where, reason=exc.reason)
        except StateError as exc:  # no key, or one others can read: nothing to trust the checkpoints with
            return ChainCheck(ok=False, where=str(home.secrets), reason=exc.message)
        return ChainCheck(ok=True, records=summary.records, checkpoints=summary.checkpoints,
                          last_checkpoint_seq=summary.last_checkpoint_seq)

    return router
