"""Changing an API key's limits after it is made: one core function (api_keys.limit) validated as
a new key is, refusing a key that is not active and leaving the registry as it was on any error;
the admin route (PATCH /admin/keys/NAME: a user their own keys, an administrator anyone's; its
audit record says the old and the new limits); `appliance keys limit`. The TUI's action is in
tests/unit/test_tui_actions.py."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from typer.testing import CliRunner

from appliance import api_keys
from appliance.api_keys import KeyState, NewLimits
from appliance.errors import Conflict, Invalid, NotFound
from appliance.home import Home
from appliance.settings import Settings
from audit import read_records
from serve.api_keys import KeyAuthenticator
from serve.auth import Principal
from serve.errors import AuthError
from serve.limits import RateLimiter
from serve.metrics import Metrics
from tests.unit.test_api_keys import Realm, make


def registry_bytes(home: Home) -> bytes:
    return (home.root / "api-keys.json").read_bytes()


# -- the core: api_keys.limit ------------------------------------------------------------------


def test_limits_change_clear_and_keep_what_is_not_named(home: Home) -> None:
    secret = make(home, "ci", models=["main"], tokens_per_minute=5000)
    before, after = api_keys.limit(home, "kate", "ci", NewLimits(models=["main", "coder"]))
    assert (before.models, before.tokens_per_minute) == (["main"], 5000)
    assert (after.models, after.tokens_per_minute) == (["main", "coder"], 5000), "the budget not named is kept"
    _, cleared = api_keys.limit(home, "kate", "ci", NewLimits(tokens_per_minute=None))
    assert (cleared.models, cleared.tokens_per_minute) == (["main", "coder"], None), "null clears it"
    _, lifted = api_keys.limit(home, "kate", "ci", NewLimits.model_validate({"models": None, "tokens_per_minute": 9}))
    assert (lifted.models, lifted.tokens_per_minute) == (None, 9)
    assert api_keys.get(home, "kate", "ci") == lifted, "written"
    assert lifted.model_dump(exclude={"models", "tokens_per_minute"}) == before.model_dump(
        exclude={"models", "tokens_per_minute"}), "nothing else changes: name, owner, hash, expiry"
    keys = KeyAuthenticator(home, Realm().lookup, owner_ttl_s=60)
    who = asyncio.run(keys.principal(secret))
    assert (who.models, who.tokens_per_minute) == (None, 9), "the gateway holds its next request to them"


def test_the_old_and_new_limits_read_as_one_line() -> None:
    now = datetime.now(UTC)
    key = api_keys.KeyDetails(name="ci", owner="kate", owner_id="id-kate", created=now, created_by="admin",
                              prefix="apk-abcdef")
    limited = key.model_copy(update={"models": ["main", "coder"], "tokens_per_minute": 5000})
    assert api_keys.described_limits(key, limited) == ("models: (its owner's) -> main, coder; "
                                                       "tokens_per_minute: (its owner's only) -> 5000")


@pytest.mark.parametrize("limits", [
    {"models": ["../m"]}, {"models": ["a b"]}, {"models": ["x" * 129]}, {"models": []},
    {"models": [f"m{n}" for n in range(17)]}, {"models": "main"},
    {"tokens_per_minute": 0}, {"tokens_per_minute": -5}, {"tokens_per_minute": 10**10},
    {"tokens_per_minute": [100]}, {"tokens_per_minute": "lots"}, {"tokens_per_minute": 1.5},
    {}, {"budget": 5},
], ids=["path", "space", "long", "no-models", "too-many", "one-not-a-list", "zero", "negative", "huge",
        "list-for-one", "words", "fraction", "nothing", "unknown-field"])
def test_limits_are_validated_as_a_new_keys_are(limits: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        NewLimits.model_validate(limits)
    creatable = {field: value for field, value in limits.items() if field in ("models", "tokens_per_minute")}
    if creatable:
        with pytest.raises(ValidationError):  # the same rule: a key could not be made with them either
            api_keys.NewKey.model_validate({"name": "k", "owner": "kate", **creatable})


def test_an_unknown_removed_revoked_or_expired_key_is_refused_and_nothing_changes(home: Home) -> None:
    make(home, "ci", tokens_per_minute=100)
    make(home, "old")
    make(home, "gone")
    api_keys.revoke(home, "kate", "old")
    api_keys.revoke(home, "kate", "gone")
    api_keys.remove(home, "kate", "gone")
    kept = registry_bytes(home)
    with pytest.raises(NotFound, match="kate has no API key named 'cd'"):
        api_keys.limit(home, "kate", "cd", NewLimits(tokens_per_minute=5))
    with pytest.raises(NotFound, match="liam has no API key named 'ci'"):
        api_keys.limit(home, "liam", "ci", NewLimits(tokens_per_minute=5))
    with pytest.raises(NotFound, match="'gone'"):
        api_keys.limit(home, "kate", "gone", NewLimits(tokens_per_minute=5))
    with pytest.raises(Conflict, match="API key 'old' of kate is revoked: its limits can no longer change"):
        api_keys.limit(home, "kate", "old", NewLimits(tokens_per_minute=5))
    later = datetime.now(UTC) + timedelta(days=2)
    make(home, "day", expires_in="1d")
    kept = registry_bytes(home)
    with pytest.raises(Conflict, match="is expired"):
        api_keys.limit(home, "kate", "day", NewLimits(tokens_per_minute=5), now=later)
    assert registry_bytes(home) == kept, "the registry is as it was"
    assert api_keys.get(home, "kate", "ci").tokens_per_minute == 100


# -- PATCH /admin/keys/NAME --------------------------------------------------------------------


class Validator:
    """A bearer token is the caller's name; `admin` holds the admin role."""

    async def validate(self, header: str | None) -> Principal:
        name = (header or "").removeprefix("Bearer ")
        if not name:
            raise AuthError("missing_token", "no token")
        roles = frozenset({"user", "admin"} if name == "admin" else {"user"})
        return Principal(subject=f"id-{name}", username=name, client="appliance-cli", roles=roles, token_id="t",
                         expires_at=float("inf"))


@pytest.fixture
def gateway(home: Home) -> TestClient:
    from serve.gateway import create_app

    app = create_app(Settings(), home)
    app.state.gateway = SimpleNamespace(validator=Validator(), metrics=Metrics(), limiter=RateLimiter({}))
    return TestClient(app, raise_server_exceptions=False)  # not entered: no lifespan, no Keycloak needed


def patch(gateway: TestClient, caller: str, path: str, body: dict[str, Any], **params: str) -> Any:
    return gateway.patch(f"/admin/keys/{path}", json=body, params=params, headers={"Authorization": f"Bearer {caller}"})


def test_an_administrator_changes_anyones_key_and_the_record_says_old_and_new(gateway: TestClient,
                                                                              home: Home) -> None:
    make(home, "ci", models=["main"])
    answer = patch(gateway, "admin", "ci", {"models": None, "tokens_per_minute": 2000}, owner="kate")
    assert answer.status_code == 200, answer.text
    shown = answer.json()
    assert (shown["owner"], shown["models"], shown["tokens_per_minute"], shown["state"]) == (
        "kate", None, 2000, KeyState.ACTIVE)
    [record] = [r for r in read_records(home.audit) if r["action"] == "keys.limit"]
    assert (record["outcome"], record["username"], record["target"]["kind"], record["target"]["name"]) == (
        "allowed", "admin", "key", "ci")
    assert record["detail"] == "models: main -> (its owner's); tokens_per_minute: (its owner's only) -> 2000"


def test_a_user_changes_their_own_key_never_anothers(gateway: TestClient, home: Home) -> None:
    make(home, "ci")
    make(home, "ci", owner="liam")
    assert patch(gateway, "kate", "ci", {"tokens_per_minute": 300}).json()["tokens_per_minute"] == 300
    refused = patch(gateway, "kate", "ci", {"tokens_per_minute": 1}, owner="liam")
    assert refused.status_code == 403 and "only an administrator" in refused.json()["error"]["message"]
    assert api_keys.get(home, "liam", "ci").tokens_per_minute is None
    assert patch(gateway, "mallory", "ci", {"tokens_per_minute": 1}).status_code == 404, "their own: none"
    outcomes = [(r["username"], r["outcome"]) for r in read_records(home.audit) if r["action"] != "keys.limit"]
    assert ("kate", "denied") in outcomes, "the refusal is audited"


@pytest.mark.parametrize(("body", "status", "says"), [
    ({"tokens_per_minute": 0}, 422, "'tokens_per_minute': Input should be greater than 0"),
    ({"models": ["../x"]}, 422, "'models.0'"),
    ({}, 422, "no limit to change"),
])
def test_bad_limits_are_refused_naming_the_field(gateway: TestClient, home: Home, body: dict[str, Any],
                                                 status: int, says: str) -> None:
    make(home, "ci", tokens_per_minute=100)
    refused = patch(gateway, "kate", "ci", body)
    assert refused.status_code == status and says in refused.text, refused.text
    assert api_keys.get(home, "kate", "ci").tokens_per_minute == 100


def test_a_revoked_key_is_refused_with_409(gateway: TestClient, home: Home) -> None:
    make(home, "ci")
    api_keys.revoke(home, "kate", "ci")
    refused = patch(gateway, "admin", "ci", {"tokens_per_minute": 5})
    assert refused.status_code == 409 and "is revoked" in refused.json()["error"]["message"]


# -- appliance keys limit ----------------------------------------------------------------------


def limited(monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[Any, list[tuple[str, str, Any, Any]]]:
    from appliance.commands import keys as keys_cli

    sent: list[tuple[str, str, Any, Any]] = []

    def admin_api(method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        sent.append((method, path, kwargs.get("json"), kwargs.get("params")))
        body = kwargs["json"]
        return {"name": "ci", "owner": "kate", "models": body.get("models"),
                "tokens_per_minute": body.get("tokens_per_minute")}

    monkeypatch.setattr(keys_cli, "admin_api", admin_api)
    return CliRunner().invoke(keys_cli.keys_app, ["limit", "ci", *args]), sent


def said(output: str) -> str:
    """The output as one line (the console wraps it at its width)."""
    return " ".join(output.split())


def test_the_cli_sends_what_is_named_and_clears_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    done, sent = limited(monkeypatch, "--model", "main", "--model", "coder", "--user", "kate")
    assert done.exit_code == 0, done.output
    assert sent == [("PATCH", "/keys/ci", {"models": ["main", "coder"]}, {"owner": "kate"})]
    assert "API key ci of kate now limited to main, coder; kate's token budget only" in said(done.output)
    done, sent = limited(monkeypatch, "--all-models", "--tokens-per-minute", "500")
    assert sent == [("PATCH", "/keys/ci", {"models": None, "tokens_per_minute": 500}, None)]
    assert "any model kate may use; 500 tokens/min of its own" in said(done.output)
    done, sent = limited(monkeypatch, "--no-token-limit")
    assert sent == [("PATCH", "/keys/ci", {"tokens_per_minute": None}, None)]


@pytest.mark.parametrize(("args", "says"), [
    ((), "no limit to change"),
    (("--model", "main", "--all-models"), "--model and --all-models together"),
    (("--tokens-per-minute", "5", "--no-token-limit"), "--tokens-per-minute and --no-token-limit together"),
])
def test_the_cli_refuses_nothing_or_both_ways_before_asking(monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...],
                                                             says: str) -> None:
    done, sent = limited(monkeypatch, *args)
    assert done.exit_code != 0 and sent == []
    assert isinstance(done.exception, Invalid) and says in done.exception.message
