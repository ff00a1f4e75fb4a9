"""Settings: defaults, TOML file, environment overrides, and errors that say where and why."""

import json
from pathlib import Path

import pytest

from appliance.errors import SettingsError
from appliance.settings import Settings, load_settings, render_defaults


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "settings.toml"
    path.write_text(text)
    return path


def test_missing_file_means_defaults(tmp_path: Path) -> None:
    settings = load_settings(tmp_path / "absent.toml", environ={})
    assert settings == Settings()
    assert settings.pools[0].name == "main" and settings.gateway.bind == "127.0.0.1"


def test_file_values_are_read(tmp_path: Path) -> None:
    path = write(tmp_path, '[engine]\nmax_model_len = 4096\n\n[[pools]]\nname = "fast"\nmax_loras = 8\n')
    settings = load_settings(path, environ={})
    assert settings.engine.max_model_len == 4096
    assert [(p.name, p.max_loras) for p in settings.pools] == [("fast", 8)]


def test_env_overrides_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[engine]\nmax_model_len = 4096\n')
    env = {"APPLIANCE_ENGINE__MAX_MODEL_LEN": "1024", "APPLIANCE_POOLS__MAIN__MAX_LORAS": "8",
           "APPLIANCE_HOME": "/ignored/here", "UNRELATED": "x"}
    settings = load_settings(path, environ=env)
    assert settings.engine.max_model_len == 1024
    assert settings.pool("main").max_loras == 8


def test_bad_value_names_file_line_and_field(tmp_path: Path) -> None:
    path = write(tmp_path, '[engine]\ndtype = "bfloat16"\nmax_model_len = -5\n')
    with pytest.raises(SettingsError) as caught:
        load_settings(path, environ={})
    assert f"{path}:3" in caught.value.message
    assert "engine.max_model_len" in caught.value.message
    assert "greater than 0" in caught.value.message


def test_bad_pool_field_names_pool_by_name_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, '[[pools]]\nname = "a"\nmax_loras = 2\n\n[[pools]]\nname = "b"\nmax_loras = 0\n')
    with pytest.raises(SettingsError) as caught:
        load_settings(path, environ={})
    assert f"{path}:7" in caught.value.message
    assert "pools.b.max_loras" in caught.value.message


def test_unknown_field_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, '[engine]\nmax_model_lenght = 10\n')
    with pytest.raises(SettingsError, match=r"engine\.max_model_lenght: Extra inputs are not permitted"):
        load_settings(path, environ={})


def test_toml_syntax_error_has_line(tmp_path: Path) -> None:
    path = write(tmp_path, '[engine]\nmax_model_len = \n')
    with pytest.raises(SettingsError, match=r"not valid TOML.*line 2"):
        load_settings(path, environ={})


def test_bad_env_override_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="APPLIANCE_ENGINE__DTYPE: engine.dtype"):
        load_settings(tmp_path / "none.toml", environ={"APPLIANCE_ENGINE__DTYPE": "int3"})
    with pytest.raises(SettingsError, match="APPLIANCE_NOPE: unknown setting"):
        load_settings(tmp_path / "none.toml", environ={"APPLIANCE_NOPE": "1"})
    with pytest.raises(SettingsError, match="no pool named 'ghost'"):
        load_settings(tmp_path / "none.toml", environ={"APPLIANCE_POOLS__GHOST__MAX_LORAS": "9"})


def test_pools_must_be_distinct(tmp_path: Path) -> None:
    path = write(tmp_path, '[[pools]]\nname = "a"\n[[pools]]\nname = "a"\n')
    with pytest.raises(SettingsError, match="two pools share name 'a'"):
        load_settings(path, environ={})


def test_engines_have_no_port_to_set(tmp_path: Path) -> None:
    """Engines listen on Unix sockets only; a TCP port or address for them is refused."""
    for text in ('[[pools]]\nname = "a"\nport = 8200\n', '[network]\nbind = "0.0.0.0"\n'):
        with pytest.raises(SettingsError, match="Extra inputs are not permitted"):
            load_settings(write(tmp_path, text), environ={})


def test_rendered_defaults_load_back_to_defaults(tmp_path: Path) -> None:
    text = render_defaults()
    assert "# Fraction of accelerator memory" in text
    sections = [name for name in Settings.model_fields if name != "pools"]
    assert all(f"\n[{name}]\n" in text for name in sections), "every section is documented"
    assert load_settings(write(tmp_path, text), environ={}) == Settings()


def test_masked_settings_hide_secrets_and_digest_follows_changes() -> None:
    plain = Settings()
    secret = Settings.model_validate({"artifacts": {"store": "s3", "s3_endpoint": "h:1", "s3_access_key": "a",
                                                    "s3_secret_key": "hunter2"}})
    assert secret.masked()["artifacts"]["s3_secret_key"] == "********"
    assert "hunter2" not in json.dumps(secret.masked())
    assert plain.digest() == Settings().digest() != secret.digest()


def test_s3_store_needs_endpoint_and_keys(tmp_path: Path) -> None:
    path = tmp_path / "settings.toml"
    path.write_text('[artifacts]\nstore = "s3"\ns3_endpoint = "127.0.0.1:9000"\n')
    with pytest.raises(SettingsError, match=r"settings.toml:1: artifacts: .*needs s3_access_key, s3_secret_key"):
        load_settings(path, environ={})


@pytest.mark.parametrize(("text", "where", "why"), [
    ('[[pools]]\nname = "main"\nextra_args = ["--x", "1\\n[program:evil]"]\n', "settings.toml:3", "U+000A"),
    ('[[pools]]\nname = "main"\nserved_model_name = "m ;command=evil"\n', "settings.toml:3", "comment"),
    ('[keycloak]\njava_home = "/opt/jdk #x"\n', "settings.toml:2", "comment"),
])
def test_values_that_would_inject_into_supervisords_config_are_refused(tmp_path: Path, text: str, where: str,
                                                                      why: str) -> None:
    """Settings reach supervisord's config file; a newline or a comment there would add
    or hide configuration."""
    with pytest.raises(SettingsError) as caught:
        load_settings(write(tmp_path, text), environ={})
    message = caught.value.one_line()
    assert where in message and why in message


def test_a_newline_in_an_environment_override_is_refused_naming_the_variable(tmp_path: Path) -> None:
    with pytest.raises(SettingsError) as caught:
        load_settings(tmp_path / "absent.toml", environ={"APPLIANCE_POOLS__MAIN__SERVED_MODEL_NAME": "a\nb"})
    assert "APPLIANCE_POOLS__MAIN__SERVED_MODEL_NAME" in caught.value.one_line()


def test_values_read_only_from_the_settings_file_may_hold_comment_characters(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, '[compliance.patterns]\nticket = "TICKET #[0-9]+"\n'), environ={})
    assert settings.compliance.patterns == {"ticket": "TICKET #[0-9]+"}


@pytest.mark.parametrize(("text", "where", "new"), [
    ('[finetune]\neval_fraction = 0.2\nsensitive_data = "redact"\n', "settings.toml:3: finetune.sensitive_data",
     "compliance.training_data"),
    ('[finetune.sensitive_patterns]\nticket = "T-[0-9]+"\n', "settings.toml:1: finetune.sensitive_patterns",
     "compliance.patterns"),
])
def test_a_moved_setting_is_refused_naming_its_new_key(tmp_path: Path, text: str, where: str, new: str) -> None:
    with pytest.raises(SettingsError) as caught:
        load_settings(write(tmp_path, text), environ={})
    assert where in caught.value.message and f"moved to {new}" in caught.value.message


def test_a_moved_setting_in_the_environment_is_refused_naming_the_variable(tmp_path: Path) -> None:
    with pytest.raises(SettingsError) as caught:
        load_settings(tmp_path / "absent.toml", environ={"APPLIANCE_FINETUNE__SENSITIVE_DATA": "allow"})
    assert caught.value.message == ("APPLIANCE_FINETUNE__SENSITIVE_DATA: finetune.sensitive_data is no longer a "
                                    "setting: it moved to compliance.training_data")
