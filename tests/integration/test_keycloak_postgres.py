"""Keycloak on the PostgreSQL the appliance supervises (`keycloak.database = "postgres"`), with an
appliance of its own: PostgreSQL runs as its own user on loopback only, its password generated and
never on a command line; Keycloak survives a PostgreSQL restart (it is not restarted itself, a
token issued before keeps working at the gateway, logins resume, a user made after it is stored
and their token, which the gateway has not seen, is confirmed by Keycloak). Keycloak's role is an ordinary
one: each way a superuser reaches the host or other roles is refused to it, and the superuser
cannot be logged into with a password; the state directory gives the database's system user
nothing but its own. An appliance whose Keycloak role was the superuser is arranged so at `up`,
its users kept. The move of an appliance from dev-file: tests/integration/test_backup.py."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from appliance.home import Home
from appliance.secrets import secret
from appliance.settings import load_settings
from appliance.supervisor import Supervisor
from installer.keycloak_dist import data_dir
from installer.postgres import (
    DB_USER,
    KEYCLOAK_DATABASE,
    KEYCLOAK_ROLE,
    KEYCLOAK_SECRET,
    SUPERUSER,
    as_db_user,
    binaries,
    db_user,
    reachable,
    socket_dir,
)
from installer.postgres import data_dir as postgres_data
from tests.integration.realm import Realm
from tests.support.appliances import Appliance, make_appliance
from tests.support.ports import free_port
from tests.support.session import Running
from tests.support.state_modes import (
    db_user_reads,
    modes_not_private,
    passages_closed,
    readable_by_db_user,
)

pytestmark = pytest.mark.alone
PASSWORD = "pg-user-password-1"


@pytest.fixture(scope="module")
def on_postgres(demo_model: Path, keycloak_dist: Path) -> Iterator[Appliance]:
    port = free_port()
    for appliance in make_appliance(demo_model, keycloak_dist, APPLIANCE_KEYCLOAK__DATABASE="postgres",
                                    APPLIANCE_KEYCLOAK__POSTGRES_PORT=str(port)):
        appliance.home.settings_file.write_text("[cache]\nttl_s = 60.0\n")  # as an editor leaves it: 0644
        appliance.home.settings_file.chmod(0o644)
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
    # The gateway may answer for that token from its introspection cache. A user made after the
    # restart is written to PostgreSQL, and a token of theirs has an id the gateway has never seen,
    # so the gateway must ask Keycloak about it: the answer proves both reached after the restart.
    assert realm.settings.gateway.introspect_ttl_s > 0, "the gateway introspects the tokens it has not seen"
    realm.ensure_user("pg-after-restart", PASSWORD, ["user"])
    stored = psql(keycloak_login(on_postgres), "select count(*) from user_entity where username = 'pg-after-restart'")
    assert stored.stdout.strip() == "1", stored.stdout + stored.stderr
    fresh = {"Authorization": f"Bearer {realm.token('pg-after-restart', PASSWORD)}"}
    answer = httpx.get(f"{gateway}/v1/models", headers=fresh, timeout=60)
    assert answer.status_code == 200, answer.text
    assert program_pids(on_postgres, "keycloak") == keycloak  # Keycloak itself went on running


def psql(environment: dict[str, str], statement: str, **more: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(binaries() / "psql"), "-X", "-tA", "-v", "ON_ERROR_STOP=1"], input=statement + ";\n",
                          env={**environment, **more}, capture_output=True, text=True, check=False)


def keycloak_login(appliance: Appliance) -> dict[str, str]:
    """libpq's environment for Keycloak's role through the running server's socket."""
    port = appliance.port("APPLIANCE_KEYCLOAK__POSTGRES_PORT")
    return {**os.environ, "PGHOST": str(socket_dir(appliance.home)), "PGPORT": str(port), "PGUSER": KEYCLOAK_ROLE,
            "PGDATABASE": KEYCLOAK_DATABASE, "PGPASSWORD": secret(appliance.home, KEYCLOAK_SECRET)}


def test_keycloaks_role_is_an_ordinary_one_owning_its_database(on_postgres: Appliance) -> None:
    login = keycloak_login(on_postgres)
    found = psql(login, "select rolsuper, rolcreaterole, rolcreatedb, rolreplication, rolbypassrls from pg_roles "
                        "where rolname = current_user")
    assert found.returncode == 0 and found.stdout.strip() == "f|f|f|f|f", found.stdout + found.stderr
    owner = psql(login, "select pg_get_userbyid(datdba) from pg_database where datname = current_database()")
    assert owner.stdout.strip() == KEYCLOAK_ROLE
    tables = psql(login, "select count(*) from pg_tables where schemaname = 'public' and tableowner = current_user")
    assert int(tables.stdout) > 50, tables.stdout  # Keycloak's schema, made by Keycloak as this role
    granted = psql(login, "select count(*) from pg_auth_members where member = (select oid from pg_roles "
                          "where rolname = current_user)")
    assert granted.stdout.strip() == "0"  # no predefined role (pg_execute_server_program, ...) either


# Each way a superuser (or a member of the predefined roles) reaches the host's programs and files or
# other roles; each must be refused to Keycloak's role.
SUPERUSER_ONLY = [
    "create temporary table loot (line text); copy loot from program 'id'",
    "copy (select 1) to program 'sh -c id'",
    "copy (select 1) to '/tmp/appliance-written-by-keycloak'",
    "create temporary table loot (line text); copy loot from '/etc/passwd'",
    "select pg_read_file('/etc/passwd')",
    "select pg_read_binary_file('postgresql.conf')",
    "select pg_ls_dir('.')",
    "select lo_import('/etc/passwd')",
    "create role intruder login superuser",
    "create role intruder",
    "create database intruder",
    "alter role current_user superuser",
    "alter role current_user createrole",
    f"set role {SUPERUSER}",
    f"set session authorization {SUPERUSER}",
    "alter system set log_connections = on",
    "create function intruder() returns void language c as '/lib/x86_64-linux-gnu/libc.so.6', 'abort'",
    "create extension file_fdw",
    "create extension adminpack",
    f"grant pg_execute_server_program to {KEYCLOAK_ROLE}",
    "select pg_reload_conf()",
    "select pg_terminate_backend(pid) from pg_stat_activity where usename <> current_user",
]


@pytest.mark.parametrize("statement", SUPERUSER_ONLY)
def test_what_only_a_superuser_may_do_is_refused_to_keycloaks_role(on_postgres: Appliance, statement: str) -> None:
    refused = psql(keycloak_login(on_postgres), statement)
    assert refused.returncode != 0 or refused.stdout.strip() in ("", "0"), refused.stdout
    if refused.returncode != 0:
        assert any(word in refused.stderr for word in ("permission denied", "must be superuser", "not allowed",
                                                       "is not available", "could not open", "only roles")), \
            refused.stderr
    assert not os.path.exists("/tmp/appliance-written-by-keycloak")


def test_the_superuser_takes_no_password_and_no_network_login(on_postgres: Appliance) -> None:
    login = keycloak_login(on_postgres)
    port = str(on_postgres.port("APPLIANCE_KEYCLOAK__POSTGRES_PORT"))
    for where in (str(socket_dir(on_postgres.home)), "127.0.0.1"):  # as root, with Keycloak's password
        refused = psql(login, "select 1", PGUSER=SUPERUSER, PGDATABASE="postgres", PGHOST=where, PGPORT=port)
        assert refused.returncode != 0 and ("authentication failed" in refused.stderr
                                            or "no pg_hba.conf entry" in refused.stderr), refused.stderr
    other = psql(login, "select 1", PGDATABASE="postgres", PGHOST="127.0.0.1", PGPORT=port)
    assert other.returncode != 0 and "no pg_hba.conf entry" in other.stderr  # Keycloak's own database alone


def test_the_database_user_reads_nothing_of_the_state_directory_but_its_own(on_postgres: Appliance) -> None:
    home = on_postgres.home
    jobs = home.root / "finetune" / "jobs" / "jobs.sqlite"
    for secret_file in (home.settings_file, jobs, home.secrets / KEYCLOAK_SECRET, home.run / "supervisord.conf"):
        assert secret_file.is_file() and not db_user_reads(secret_file), secret_file
    assert readable_by_db_user(home) == []
    assert passages_closed(home) == {} and modes_not_private(home) == {}


def as_its_superuser(home: Home, data: Path, commands: list[list[str]]) -> None:
    """A cluster served on its socket for a moment, `commands` (libpq's tools) run as its bootstrap
    role (with its password)."""
    control = as_db_user([str(binaries() / "pg_ctl"), "-D", str(data)])
    subprocess.run([*control, "-w", "-o", f"-c listen_addresses= -p 5499 -k {socket_dir(home)}", "-l",
                    str(socket_dir(home) / "old.log"), "start"], check=True, capture_output=True)
    try:
        login = {**os.environ, "PGHOST": str(socket_dir(home)), "PGPORT": "5499", "PGUSER": KEYCLOAK_ROLE,
                 "PGDATABASE": "postgres", "PGPASSWORD": secret(home, KEYCLOAK_SECRET)}
        for command in commands:
            done = subprocess.run(command, env=login, capture_output=True, text=True, check=False)
            assert done.returncode == 0, done.stderr
    finally:
        subprocess.run([*control, "-w", "-m", "fast", "stop"], check=True, capture_output=True)


def downgrade_to_a_superuser_role(appliance: Appliance, tmp_path: Path) -> None:
    """The cluster as an appliance made it when Keycloak's role was the superuser: initdb's bootstrap
    role `keycloak` with Keycloak's password, SCRAM logins for all, Keycloak's tables in database
    `postgres`, owned by it (the current tables copied there)."""
    home = appliance.home
    settings = load_settings(home.settings_file, appliance.env)
    dump = tmp_path / "keycloak.dump"
    with reachable(home, settings.keycloak) as environment:
        subprocess.run([str(binaries() / "pg_dump"), "--format=custom", f"--file={dump}"], env=environment,
                       check=True, capture_output=True)
    user = db_user()
    data = postgres_data(home)
    shutil.rmtree(data)
    password = data.with_name("password")
    password.write_text(secret(home, KEYCLOAK_SECRET))
    os.chown(password, user.pw_uid, user.pw_gid)
    subprocess.run(as_db_user([str(binaries() / "initdb"), "-D", str(data), "-U", KEYCLOAK_ROLE,
                               "--auth-local=scram-sha-256", "--auth-host=scram-sha-256", f"--pwfile={password}",
                               "--encoding=UTF8", "--locale=C", "--no-instructions"]), check=True, capture_output=True)
    password.unlink()
    as_its_superuser(home, data, [[str(binaries() / "pg_restore"), "--no-owner", "--exit-on-error",
                                   "--dbname=postgres", str(dump)]])


def test_an_appliance_whose_keycloak_role_was_the_superuser_is_arranged_at_up_keeping_its_users(
        on_postgres: Appliance, realm: Realm, tmp_path: Path) -> None:
    assert on_postgres.run("down").returncode == 0
    downgrade_to_a_superuser_role(on_postgres, tmp_path)
    started = on_postgres.run("up")
    assert started.returncode == 0, started.stdout + started.stderr
    assert "Keycloak's database role becomes an ordinary one" in started.stderr
    assert realm.token("pg-user", PASSWORD)  # the user (and its password hash) came over
    login = keycloak_login(on_postgres)
    found = psql(login, "select rolsuper, rolcreaterole, rolcreatedb from pg_roles where rolname = current_user")
    assert found.stdout.strip() == "f|f|f", found.stdout + found.stderr
    assert psql(login, "create temporary table loot (line text); copy loot from program 'id'").returncode != 0
    bootstrap = psql(login, "select rolname from pg_roles where oid = 10")
    assert bootstrap.stdout.strip() == SUPERUSER
    again = on_postgres.run("down"), on_postgres.run("up")  # once only
    assert again[1].returncode == 0 and "becomes an ordinary one" not in again[1].stderr, again[1].stderr
