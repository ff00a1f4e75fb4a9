"""The embedded Keycloak on the organisation's PostgreSQL (`keycloak.postgres_url`), the program
`appliance up` would supervise run as it is: over TLS only, the server's certificate verified
against the configured CA and its name checked. Keycloak started with a CA that did not certify the
server refuses to start and writes nothing; with the right CA it makes its schema there and
answers its health check. No supervised PostgreSQL runs. (A stand-in server: tests/support/external_postgres.)"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from appliance.home import Home
from appliance.settings import KeycloakSettings, Settings
from appliance.tls import ca_file
from installer.keycloak import keycloak_programs
from installer.keycloak_dist import install_dir
from tests.support.certificates import organisation_chain
from tests.support.external_postgres import ExternalPostgres, external_postgres
from tests.support.ports import free_port


@pytest.fixture(scope="module")
def external() -> Iterator[ExternalPostgres]:
    with external_postgres() as server:
        yield server


@pytest.fixture(scope="module")
def home(keycloak_dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Home:
    home = Home(tmp_path_factory.mktemp("external-db") / "h").ensure()
    shutil.copytree(keycloak_dist, install_dir(home), symlinks=True, ignore=shutil.ignore_patterns("h2", "tmp"))
    return home


def keycloak(home: Home, settings: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    """The supervised program's command and environment, started as supervisord would; its health URL."""
    port, management = free_port(), free_port()
    [program] = keycloak_programs(Settings(keycloak=KeycloakSettings(
        port=port, management_port=management, **settings)), home)  # type: ignore[arg-type]
    assert not program.missing, program.missing
    assert program.environment["KC_DB_PASSWORD"] not in " ".join(program.command)
    assert "sslmode=verify-full" in " ".join(program.command) and program.health_url
    return subprocess.Popen(program.command, env={**os.environ, **program.environment}, cwd=program.directory,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), program.health_url


def stop(process: subprocess.Popen[str]) -> str:
    if process.poll() is None:
        process.terminate()
    output, _ = process.communicate(timeout=120)
    return output


def test_keycloak_refuses_a_server_its_ca_did_not_certify(home: Home, external: ExternalPostgres,
                                                          tmp_path: Path) -> None:
    stranger = organisation_chain(tmp_path / "stranger", ["localhost"]).root
    process, _ = keycloak(home, external.settings(stranger))
    try:
        process.wait(timeout=240)
    finally:
        output = stop(process)
    assert process.returncode != 0, output[-3000:]
    assert re.search(r"PKIX path (building|validation) failed|unable to find valid certification path", output), \
        output[-3000:]  # the certificate was checked and refused
    assert external.tables() == 0  # nothing was written before the server was trusted


def test_keycloak_runs_on_the_external_server_over_verified_tls(home: Home, external: ExternalPostgres) -> None:
    process, url = keycloak(home, external.settings())
    try:
        deadline = time.monotonic() + 300
        while True:
            assert process.poll() is None, stop(process)[-3000:]
            try:
                if httpx.get(url, verify=str(ca_file(home)), timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "Keycloak did not become ready on the external database"
            time.sleep(1)
        assert external.tables() > 50  # Keycloak's schema, made over the TLS connection
    finally:
        stop(process)
