"""The admin API in process, without Keycloak: an app whose token validator says the caller holds
the roles a test sets (administrator by default)."""

from __future__ import annotations

from types import SimpleNamespace

from fastapi.testclient import TestClient

from appliance.home import Home
from appliance.settings import Settings
from serve.auth import Principal
from serve.gateway import create_app
from serve.metrics import Metrics


class Caller:
    """The token validator, as if the caller held `roles`."""

    def __init__(self) -> None:
        self.roles = frozenset({"admin"})

    async def validate(self, header: str | None) -> Principal:
        return Principal(subject="s", username="root", client="c", roles=self.roles, token_id="t",
                         expires_at=float("inf"))


def admin_client(home: Home) -> tuple[TestClient, Caller]:
    app = create_app(Settings(), home)
    caller = Caller()
    app.state.gateway = SimpleNamespace(validator=caller, metrics=Metrics())
    return TestClient(app, raise_server_exceptions=False), caller  # not entered: no lifespan, no Keycloak
