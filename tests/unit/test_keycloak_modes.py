"""Embedded vs external Keycloak: one code path, provisioning and the program only when embedded."""

from pathlib import Path

import pytest

from appliance.errors import SettingsError
from appliance.home import Home
from appliance.settings import KeycloakSettings, Settings, load_settings
from appliance.tls import server_files
from installer.keycloak import BUILD_OPTIONS, POSTGRES_BUILD_OPTIONS, KeycloakError, build, keycloak_programs
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
