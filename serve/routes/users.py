"""/admin/roles and /admin/users (role `admin`): the realm's users and their roles, through
appliance.users (which translates Keycloak's errors). Plain functions: Keycloak's admin client blocks."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel

from appliance.home import Home
from appliance.roles import Role
from appliance.settings import Settings
from appliance.users import CreatedUser, NewPassword, NewUser, PasswordReset, User, Users
from serve.audit_trail import REFRESHED, note_target
from serve.deps import requires


class RoleGrant(BaseModel):
    role: Role


def router(settings: Settings, home: Home) -> APIRouter:
    routes = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(requires("admin"))])

    @routes.get("/roles", response_model=list[Role], name="roles.list")
    def roles() -> list[Role]:
        """The realm roles the appliance uses."""
        return list(Role)

    @routes.get("/users", response_model=list[User], name="users.list", openapi_extra=REFRESHED)
    def users() -> list[User]:
        """Users of the realm with their appliance roles."""
        return Users(settings, home).listing()

    @routes.post("/users", response_model=CreatedUser, status_code=201, name="users.add")
    def add_user(request: Request, new: NewUser) -> CreatedUser:
        """Create an enabled user with roles; without a password, one is generated and returned once."""
        note_target(request, "user", new.username, roles=sorted(new.roles))
        return Users(settings, home).add(new)

    @routes.post("/users/{username}/disable", response_model=User, name="users.disable")
    def disable_user(username: str) -> User:
        """Disable a user: new logins fail; live tokens stop within the introspection interval."""
        return Users(settings, home).disable(username)

    @routes.post("/users/{username}/enable", response_model=User, name="users.enable")
    def enable_user(username: str) -> User:
        """Let a disabled user log in again."""
        return Users(settings, home).enable(username)

    @routes.post("/users/{username}/unlock", response_model=User, name="users.unlock")
    def unlock_user(username: str) -> User:
        """Clear a user's failed logins and lockout (brute-force detection locks per account)."""
        return Users(settings, home).unlock(username)

    @routes.post("/users/{username}/roles", response_model=User, name="users.grant")
    def grant_role(request: Request, username: str, grant: RoleGrant) -> User:
        """Grant a user one more realm role (granting one it holds changes nothing)."""
        note_target(request, "user", username, roles=[grant.role])
        return Users(settings, home).grant(username, grant.role)

    @routes.delete("/users/{username}/roles/{role}", response_model=User, name="users.revoke")
    def revoke_role(request: Request, username: str, role: Role) -> User:
        """Revoke a realm role from a user; never the last enabled administrator's admin role."""
        note_target(request, "user", username, roles=[role])
        return Users(settings, home).revoke(username, role)

    @routes.post("/users/{username}/password", response_model=PasswordReset, name="users.reset_password")
    def reset_password(username: str, new: NewPassword) -> PasswordReset:
        """Set a user's password; without one, one is generated and returned once."""
        return Users(settings, home).reset_password(username, new.password)

    return routes
