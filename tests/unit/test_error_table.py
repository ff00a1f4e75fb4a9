"""The core's errors reach HTTP through one table (serve.errors.from_core), and anything the
gateway did not expect is still an OpenAI-shaped 500 with the request id, never plain text."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from appliance.errors import (
    ApplianceError,
    Conflict,
    IntegrityError,
    Invalid,
    NotFound,
    SettingsError,
    StateError,
    SupervisorError,
    Unavailable,
)
from appliance.home import Home
from appliance.settings import Settings
from audit import read_records
from serve.auth import Principal
from serve.errors import from_core
from serve.gateway import create_app
from serve.metrics import Metrics


class Anyone:
    """Every /v1 route needs a caller: this one, whatever the header says."""

    async def validate(self, header: str | None) -> Principal:
        return Principal(subject="s", username="u", client="c", roles=frozenset({"user"}), token_id="t",
                         expires_at=float("inf"))


@pytest.mark.parametrize(("error", "status", "code"), [
    (Invalid("bad"), 400, "invalid"), (SettingsError("bad"), 400, "settings"),
    (NotFound("none"), 404, "not_found"), (Conflict("busy"), 409, "conflict"),
    (IntegrityError("changed"), 409, "artifact_integrity"), (Unavailable("down"), 503, "unavailable"),
    (StateError("broken"), 503, "state"), (SupervisorError("gone"), 503, "supervisor"),
    (ApplianceError("odd"), 500, "appliance_error"),
])
def test_each_core_error_family_has_one_status(error: ApplianceError, status: int, code: str) -> None:
    answer = from_core(error)
    assert (answer.status, answer.code, answer.message) == (status, code, error.message)
    assert ("Retry-After" in answer.headers) == (status == 503)


def test_core_and_unexpected_errors_are_openai_shaped_and_recorded(home: Home) -> None:
    app = create_app(Settings(), home)

    async def broken_registry() -> None:
        raise StateError("the adapter registry (adapters.json in the state directory) is unreadable: line 1")

    async def bug() -> None:
        raise KeyError("a bug")

    app.state.gateway = SimpleNamespace(validator=Anyone(), metrics=Metrics())
    app.add_api_route("/v1/broken", broken_registry, name="test.broken")
    app.add_api_route("/v1/bug", bug, name="test.bug")
    client = TestClient(app, raise_server_exceptions=False)  # not entered: no lifespan, no Keycloak needed
    broken = client.get("/v1/broken")
    failed = client.get("/v1/bug")
    assert broken.status_code == 503 and broken.headers["content-type"] == "application/json"
    assert broken.json()["error"]["code"] == "state" and "adapters.json" in broken.json()["error"]["message"]
    assert failed.status_code == 500 and failed.headers["content-type"] == "application/json"
    error = failed.json()["error"]
    assert error["code"] == "internal_error" and "a bug" not in failed.text  # details go to the log
    records = {r["action"]: r for r in read_records(home.audit)}
    assert {action: r["status"] for action, r in records.items()} == {"test.broken": 503, "test.bug": 500}
    assert f"(request {records['test.bug']['request_id']})" in error["message"]  # to find it in the log by
