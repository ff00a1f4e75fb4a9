"""Who and what a local CLI change is recorded as: the person logged in at the CLI (the OS user
beside them), else the OS user; the caller's mistakes as `invalid`, the appliance's as `error`."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from appliance import cli, login
from appliance.changes import Change, failure_outcome, records_change
from appliance.errors import Invalid
from appliance.home import HOME_ENV, Home
from audit import read_records
from audit.cli import record_change
from finetune.datasets import DatasetError
from finetune.evalsets import EvalSetError, parse
from tests.support.tokens import here, jwt

UID = f"uid:{os.getuid()}"


def cached(home: Home, access_s: float = 300, refresh_s: float = 1800, **claims: Any) -> login.CachedToken:
    """A login of admin at this host's realm, its claims changed by `claims` (None leaves one out)."""
    now = time.time()
    fields = {"preferred_username": "admin", "sub": "0b5c-uuid", "azp": "appliance-cli", "iss": here(home).issuer,
              **claims}
    return login.CachedToken(username="admin", access_token=jwt(**{k: v for k, v in fields.items() if v is not None}),
                             refresh_token="r", expires_at=now + access_s, refresh_expires_at=now + refresh_s)


def recorded(home: Home) -> dict[str, Any]:
    *_, last = read_records(home.audit)
    return last


def test_a_logged_in_person_is_who_acted_and_the_os_user_is_kept(home: Home) -> None:
    login.save(here(home), cached(home))
    record_change(home, Change("data.add", "allowed", 0))
    record = recorded(home)
    assert (record["username"], record["subject"]) == ("admin", "0b5c-uuid")
    assert (record["client"], record["source"], record["resource"]) == ("appliance-cli", f"via local CLI as {UID}",
                                                                         "cli")


def test_an_expired_access_token_with_a_live_refresh_token_is_still_the_login(home: Home) -> None:
    login.save(here(home), cached(home, access_s=-60, refresh_s=600))
    record_change(home, Change("data.add", "allowed", 0))
    assert recorded(home)["username"] == "admin"


@pytest.mark.parametrize("changes", [
    None,  # not logged in
    {"access_s": -60, "refresh_s": -1},  # the whole login has expired
    {"iss": "https://elsewhere/realms/appliance"},
    {"azp": "other-client"},
    {"sub": None},
    {"preferred_username": None},
], ids=["none", "expired", "another-realm", "another-client", "no-subject", "no-username"])
def test_without_a_valid_login_the_os_user_is_who_acted(home: Home, changes: dict[str, Any] | None) -> None:
    if changes is not None:
        login.save(here(home), cached(home, **changes))
    record_change(home, Change("data.add", "allowed", 0))
    record = recorded(home)
    assert (record["subject"], record["client"], record["source"]) == (UID, "appliance-cli", "local")
    assert record["username"] != "admin"


def test_a_token_that_is_not_a_jwt_is_no_login(home: Home) -> None:
    login.save(here(home), login.CachedToken(username="admin", access_token="not-a-jwt", refresh_token="r",
                                             expires_at=time.time() + 300, refresh_expires_at=time.time() + 600))
    record_change(home, Change("data.add", "allowed", 0))
    assert recorded(home)["subject"] == UID


def test_a_service_of_the_appliance_is_itself_whoever_is_logged_in(home: Home) -> None:
    login.save(here(home), cached(home))
    record_change(home, Change("backup.create", "allowed", 0, actor="backup-schedule"))
    record = recorded(home)
    assert (record["username"], record["client"], record["source"]) == ("backup-schedule", "backup-schedule", "local")


# -- outcomes ----------------------------------------------------------------------------------


def appliance(home: Home, *args: str) -> Any:
    return CliRunner().invoke(cli.app, list(args), env={HOME_ENV: str(home.root)})


def test_an_unknown_dataset_is_the_callers_mistake(home: Home) -> None:
    login.save(here(home), cached(home))
    refused = appliance(home, "finetune", "submit", "--data", "no-such-set", "--name", "bot")
    assert refused.exit_code == 1
    record = recorded(home)
    assert (record["action"], record["outcome"], record["reason"], record["status"]) == \
        ("finetune.submit", "invalid", "not_found", 1)
    assert "no dataset named 'no-such-set'" in record["error"] and record["username"] == "admin"


def test_a_bad_name_is_the_callers_mistake(home: Home, tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("{}\n")
    refused = appliance(home, "data", "add", str(rows), "--name", "Bad Name!")
    assert refused.exit_code == 1
    record = recorded(home)
    assert (record["action"], record["outcome"], record["reason"]) == ("data.add", "invalid", "invalid")
    assert record["target"]["name"] == "Bad Name!"


def test_a_bad_file_is_the_callers_mistake(tmp_path: Path) -> None:
    broken = tmp_path / "set.jsonl"
    broken.write_text("{not json\n")
    with pytest.raises(EvalSetError) as caught:
        parse(broken)
    assert isinstance(caught.value, Invalid) and failure_outcome(caught.value) == "invalid"
    assert issubclass(DatasetError, Invalid)


def test_only_an_unexpected_failure_is_the_appliances(home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HOME_ENV, str(home.root))

    @records_change("data.add")
    def broken() -> None:
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError):
        broken()
    record = recorded(home)
    assert (record["outcome"], record["reason"], record["error"]) == ("error", "RuntimeError", "ended by RuntimeError")
