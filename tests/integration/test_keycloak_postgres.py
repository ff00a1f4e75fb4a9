"""Keycloak on the PostgreSQL the appliance supervises (`keycloak.database = "postgres"`), with an
appliance of its own: PostgreSQL runs as its own user on loopback only, its password generated and
never on a command line; Keycloak survives a PostgreSQL restart (it is not restarted itself, a
token issued before keeps working at the gateway, logins resume). The move of an appliance from
dev-file: tests/integration/test_backup.py."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from appliance.secrets import secret
from appliance.supervisor import Supervisor
from installer.keycloak import data_dir
from installer.postgres import DB_USER, KEYCLOAK_SECRET, socket_dir
from installer.postgres import data_dir as postgres_data
from tests.integration.realm import Realm
from tests.support.appliances import Appliance, make_appliance
from tests.support.ports import free_port
from tests.support.session import Running

pytestmark = pytest.mark.alone
PASSWORD = "pg-user-password-1"


@pytest.fixture(scope="module")
def on_postgres(demo_model: Path, keycloak_dist: Path) -> Iterator[Appliance]:
    port = free_port()
    for appliance in make_appliance(demo_model, keycloak_dist, APPLIANCE_KEYCLOAK__DATABASE="postgres",
                                    APPLIANCE_KEYCLOAK__POSTGRES_PORT=str(port)):
        started = appliance.run("up")
        assert started.returncode == 0, started.stdout + started.stderr
        yield appliance


@pytest.fixture(scope="module")
def realm(on_postgres: Appliance) -> Realm:
    realm = Realm(Running(on_postgres, "", 0.0))
    realm.ensure_user("pg-user", PASSWORD, ["user"])
    return realm


def program_pids(appliance: Appliance, name: str) -> int:
    [info] = [p for p in Supervisor(appliance.home).processes() if p.name == name]
    return info.pid


def test_postgres_runs_as_its_own_user_on_loopback_with_a_generated_password(on_postgres: Appliance) -> None:
    home = on_postgres.home
    port = on_postgres.port("APPLIANCE_KEYCLOAK__POSTGRES_PORT")
    # This appliance's server and its children (the session appliance runs a PostgreSQL of its own).
    [postmaster] = [p for p in psutil.process_iter(["username", "cmdline"]) if p.info["username"] == DB_USER
                    and str(postgres_data(home)) in " ".join(p.info["cmdline"] or [])]
    servers = [postmaster, *postmaster.children(recursive=True)]
    listening = {conn.laddr for conn in psutil.net_connections("tcp") if conn.status == psutil.CONN_LISTEN
                 and conn.pid in {p.pid for p in servers}}
    assert listening and all(address.ip == "127.0.0.1" and address.port == port for address in listening), listening
    password = secret(home, KEYCLOAK_SECRET)
    assert len(password) >= 32 and stat.S_IMODE((home.secrets / KEYCLOAK_SECRET).stat().st_mode) == 0o600
    for process in psutil.process_iter(["cmdline"]):
        assert password not in " ".join(process.info["cmdline"] or []), process
    for private in (postgres_data(home), socket_dir(home)):
        found = private.stat()
        assert stat.S_IMODE(found.st_mode) == 0o700 and found.st_uid == servers[0].uids().real, private
    h2 = data_dir(home) / "h2"
    assert not h2.exists() or not any(h2.iterdir())  # Keycloak's data is in PostgreSQL


def niceness_of_each_thread(process: psutil.Process) -> set[int]:
    tasks = Path(f"/proc/{process.pid}/task")
    return {int((task / "stat").read_text().rsplit(")", 1)[1].split()[16]) for task in tasks.iterdir()}


@pytest.mark.skipif(os.geteuid() != 0, reason="returning a process to niceness 0 needs root or CAP_SYS_NICE")
def test_keycloak_and_postgres_start_niced_and_run_at_normal_priority_once_up(on_postgres: Appliance) -> None:
    """What the engines do not need (Keycloak, PostgreSQL, monitoring, the queue workers) starts at
    engine.yield_nice, so the engines load first; `up` puts every process and thread of theirs back
    to 0, PostgreSQL's backends (sessions of their own) included. The engines and the gateway are
    never niced."""
    config = (on_postgres.home.run / "supervisord.conf").read_text()
    niced = {line.split("appliance.orphans ")[1].split()[0] for line in config.splitlines() if "--nice 19" in line}
    assert niced == {"keycloak", "postgres", "prometheus", "alertmanager", "finetune-worker", "rl-worker",
                     "batch-worker", "watchdog"}
    for name in sorted(niced):
        leader = psutil.Process(program_pids(on_postgres, name))
        for process in [leader, *leader.children(recursive=True)]:
            assert niceness_of_each_thread(process) == {0}, (name, process.cmdline()[:3])


def until(check: Callable[[], bool], what: str, timeout_s: float = 90) -> float:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.5)
    return time.monotonic() - started


def test_keycloak_survives_a_postgres_restart(on_postgres: Appliance, realm: Realm) -> None:
    gateway = f"http://127.0.0.1:{on_postgres.port('APPLIANCE_GATEWAY__PORT')}"
    token = realm.token("pg-user", PASSWORD)
    bearer = {"Authorization": f"Bearer {token}"}
    assert httpx.get(f"{gateway}/v1/models", headers=bearer, timeout=60).status_code == 200
    keycloak = program_pids(on_postgres, "keycloak")
    supervisor = Supervisor(on_postgres.home)
    supervisor.call("stopProcess", "postgres", True)
    supervisor.call("startProcess", "postgres", True)

    def logs_in() -> bool:
        try:
            return bool(realm.token("pg-user", PASSWORD))
        except httpx.HTTPError:
            return False

    until(logs_in, "a login after PostgreSQL's restart")
    until(lambda: httpx.get(f"{gateway}/v1/models", headers=bearer, timeout=60).status_code == 200,
          "the earlier token at the gateway")
    assert program_pids(on_postgres, "keycloak") == keycloak  # Keycloak itself went on running
