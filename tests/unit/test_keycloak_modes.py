"""Embedded vs external Keycloak: one code path, provisioning and the program only when embedded."""

from pathlib import Path

import pytest

from appliance.errors import SettingsError, StateError
from appliance.home import Home
from appliance.settings import KeycloakSettings, Settings, load_settings
from appliance.tls import server_files
from installer.keycloak import keycloak_programs
from installer.keycloak_dist import BUILD_OPTIONS, POSTGRES_BUILD_OPTIONS, KeycloakError, build, install_dir
from installer.realm import provision


def test_external_keycloak_runs_nothing_and_provisions_nothing(home: Home) -> None:
    settings = Settings(keycloak=KeycloakSettings(mode="external", url="https://idp.corp:8443/",
                                                  realm="llm", gateway_client_secret="s"))
    assert keycloak_programs(settings, home) == []
    assert provision(settings, home).created == []
    assert settings.keycloak.issuer == "https://idp.corp:8443/realms/llm"


def test_embedded_keycloak_is_a_loopback_program_on_tls_only(home: Home) -> None:
    [program] = keycloak_programs(Settings(), home)
    assert program.command[1:4] == ["start", *POSTGRES_BUILD_OPTIONS]  # development mode keeps a plain-HTTP listener
    assert "--cache=local" in program.command  # no cluster listeners
    assert "--http-host=127.0.0.1" in program.command and "--http-enabled=false" in program.command
    assert "--https-port=8180" in program.command
    assert "--hostname=https://127.0.0.1:8180" in program.command
    certificate, key = server_files(home, "keycloak")
    assert f"--https-certificate-file={certificate}" in program.command
    assert f"--https-certificate-key-file={key}" in program.command
    assert program.health_url == "https://127.0.0.1:9180/health/ready"
    assert program.missing and "not installed" in program.missing
    assert program.environment["KC_BOOTSTRAP_ADMIN_PASSWORD"] not in " ".join(program.command)


def test_external_mode_needs_url_and_secret(tmp_path: Path) -> None:
    path = tmp_path / "settings.toml"
    path.write_text('[keycloak]\nmode = "external"\n')
    with pytest.raises(SettingsError, match="external mode needs url and gateway_client_secret"):
        load_settings(path, environ={})


def test_an_external_keycloak_over_plain_http_is_refused(tmp_path: Path) -> None:
    """The gateway would send its client secret there and trust the keys it serves."""
    path = tmp_path / "settings.toml"
    path.write_text('[keycloak]\nmode = "external"\nurl = "http://idp.corp:8080"\ngateway_client_secret = "s"\n')
    with pytest.raises(SettingsError, match="keycloak.*must be reached over https://"):
        load_settings(path, environ={})


@pytest.mark.integration
def test_the_build_step_runs_once_per_install_and_its_failure_is_reported(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    dist = tmp_path / "keycloak"
    (dist / "bin").mkdir(parents=True)
    (dist / "lib").mkdir()
    script = dist / "bin" / "kc.sh"
    script.write_text('#!/bin/sh\necho "$@" >> "$(dirname "$0")/calls"\n'
                      '[ -z "$FAIL" ] || { echo broken >&2; exit 3; }\n')
    script.chmod(0o755)
    assert build(dist, tmp_path / "jdk") is True
    assert build(dist, tmp_path / "jdk") is False
    assert (dist / "bin" / "calls").read_text().splitlines() == [" ".join(("build", *BUILD_OPTIONS))]
    (dist / "lib" / ".appliance-build").unlink()
    monkeypatch.setenv("FAIL", "1")
    with pytest.raises(KeycloakError, match="kc.sh build` failed.*broken"):
        build(dist, tmp_path / "jdk")
    assert not (dist / "lib" / ".appliance-build").exists()


def test_keycloak_on_an_external_postgres_verifies_its_certificate_and_keeps_the_password_off_argv(
        home: Home, tmp_path: Path) -> None:
    password = tmp_path / "password"
    password.write_text("the-external-password\n")
    password.chmod(0o600)
    keycloak = KeycloakSettings(postgres_url="postgresql://kc@db.bank.internal:6432/keycloak",
                                postgres_password_file=str(password), postgres_ca_file="/etc/bank/root.pem")
    dist = install_dir(home) / "bin"
    dist.mkdir(parents=True)
    (dist / "kc.sh").write_text("#!/bin/sh\n")
    (dist / "kc.sh").chmod(0o755)
    (install_dir(home) / "lib").mkdir()
    (install_dir(home) / "lib" / ".appliance-build").write_text(" ".join(POSTGRES_BUILD_OPTIONS))
    [program] = keycloak_programs(Settings(keycloak=keycloak), home)  # no supervised PostgreSQL
    assert ("--db-url=jdbc:postgresql://db.bank.internal:6432/keycloak?sslmode=verify-full"
            "&sslrootcert=/etc/bank/root.pem") in program.command
    assert "--db-username=kc" in program.command and program.command[0].endswith("kc.sh")
    assert program.environment["KC_DB_PASSWORD"] == "the-external-password"
    password.chmod(0o640)
    with pytest.raises(StateError, match="readable by others"):
        keycloak_programs(Settings(keycloak=keycloak), home)


@pytest.mark.parametrize(("fields", "message"), [
    ({"postgres_url": "postgresql://kc@db/kc", "postgres_ca_file": None}, "needs postgres_password_file and"),
    ({"postgres_url": "postgresql://kc:pw@db/kc"}, "holds a password"),
    ({"postgres_url": "postgresql://kc@db/kc?socketFactory=x"}, "use postgresql://USER@HOST"),
    ({"postgres_url": "postgresql://kc@db/kc&sslmode=disable"}, "use postgresql://USER@HOST"),
    ({"postgres_url": "postgresql://kc@db/kc", "postgres_ca_file": "/ca.pem&sslmode=disable"}, "an absolute path"),
    ({"postgres_url": "mysql://kc@db/kc"}, "use postgresql://USER@HOST"),
    ({"postgres_url": "postgresql://kc@db/kc", "database": "dev-file"}, "needs database"),
    ({"postgres_ca_file": "/ca.pem"}, "go with postgres_url"),
])
def test_an_external_postgres_that_cannot_be_reached_safely_is_refused(fields: dict[str, str], message: str) -> None:
    defaults = {"postgres_password_file": "/p", "postgres_ca_file": "/ca.pem"} if "postgres_url" in fields else {}
    with pytest.raises(ValueError, match=message):
        KeycloakSettings(**{**defaults, **fields})
