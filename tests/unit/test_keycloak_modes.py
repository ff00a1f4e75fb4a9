"""Embedded vs external Keycloak: one code path, provisioning and the program only when embedded."""

from pathlib import Path

import pytest

from appliance.errors import SettingsError
from appliance.home import Home
from appliance.settings import KeycloakSettings, Settings, load_settings
from installer.keycloak import keycloak_programs
from installer.realm import provision


def test_external_keycloak_runs_nothing_and_provisions_nothing(tmp_path: Path) -> None:
    home = Home(tmp_path).ensure()
    settings = Settings(keycloak=KeycloakSettings(mode="external", url="https://idp.corp:8443/",
                                                  realm="llm", gateway_client_secret="s"))
    assert keycloak_programs(settings, home) == []
    assert provision(settings, home).created == []
    assert settings.keycloak.issuer == "https://idp.corp:8443/realms/llm"


def test_embedded_keycloak_is_a_loopback_program(tmp_path: Path) -> None:
    home = Home(tmp_path).ensure()
    [program] = keycloak_programs(Settings(), home)
    assert "--http-host=127.0.0.1" in program.command
    assert "--hostname=http://127.0.0.1:8180" in program.command
    assert program.health_url == "http://127.0.0.1:9180/health/ready"
    assert program.missing and "not installed" in program.missing
    assert program.environment["KC_BOOTSTRAP_ADMIN_PASSWORD"] not in " ".join(program.command)


def test_external_mode_needs_url_and_secret(tmp_path: Path) -> None:
    path = tmp_path / "settings.toml"
    path.write_text('[keycloak]\nmode = "external"\n')
    with pytest.raises(SettingsError, match="external mode needs url and gateway_client_secret"):
        load_settings(path, environ={})
