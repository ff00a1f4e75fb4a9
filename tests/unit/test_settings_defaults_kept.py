"""Setting one field of a table whose defaults hold several entries changes that field alone: the
other entries and the entry's other fields keep their defaults (the roles' limits: a user role's
request rate set alone must not drop the admin role's limits, whose users would then be held to the
user role's), and `settings set` refuses any edit that would change another setting in effect."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.errors import Invalid, SettingsError
from appliance.home import Home
from appliance.settings import load_settings
from appliance.settings.gateway import WHOLE_CONTEXT, default_limits
from appliance.settings_changes import flatten, set_value


def settings_from(tmp_path: Path, text: str) -> dict:
    path = tmp_path / "settings.toml"
    path.write_text(text)
    return load_settings(path, environ={}).gateway.limits


def test_a_role_s_field_given_alone_keeps_the_other_roles_and_fields(tmp_path: Path) -> None:
    limits = settings_from(tmp_path, "[gateway]\nlimits.user.requests_per_minute = 61\n")
    assert limits["admin"] == default_limits()["admin"]
    assert limits["user"] == default_limits()["user"].model_copy(update={"requests_per_minute": 61})
    admin = settings_from(tmp_path, "[gateway.limits.admin]\nrequests_per_minute = 9000\n")["admin"]
    assert (admin.requests_per_minute, admin.max_tokens, admin.max_n) == (9000, WHOLE_CONTEXT, 16)
    analyst = settings_from(tmp_path, "[gateway.limits.analyst]\nmax_n = 2\n")["analyst"]
    assert analyst.max_n == 2 and analyst.requests_per_minute == default_limits()["user"].requests_per_minute


def test_a_bad_field_is_still_named_where_it_is(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"limits\.user\.requests_per_minute"):
        settings_from(tmp_path, "[gateway]\nlimits.user.requests_per_minute = 0\n")


@pytest.mark.parametrize("key, value", [("gateway.limits.user.requests_per_minute", "61"),
                                        ("gateway.limits.admin.max_n", "8"),
                                        ("gateway.limits.analyst.max_n", "2"),
                                        ("gateway.max_body_bytes", "4096")])
def test_settings_set_changes_in_effect_the_key_alone(tmp_path: Path, key: str, value: str) -> None:
    home = Home(tmp_path / "h").ensure()
    before = flatten(load_settings(home.settings_file, environ={}).masked())
    set_value(home, key, value, environ={})
    after = flatten(load_settings(home.settings_file, environ={}).masked())
    changed = {name for name in before.keys() | after.keys() if before.get(name) != after.get(name)
               and not key.startswith(f"{name}.")}  # the tables holding it change with it
    entry = key.rsplit(".", 1)[0]
    assert key in changed and all(name == key or (name not in before and name.startswith(f"{entry}."))
                                  for name in changed), changed


def test_settings_set_refuses_an_edit_that_would_change_another_setting(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the cause (a table whose other entries the file would replace, as the roles' limits
    did before their defaults were kept; here an edit that touches a second key), nothing is written."""
    from appliance.settings import editing

    home = Home(tmp_path / "h").ensure()
    home.settings_file.write_text("[gateway]\nport = 8443\n")
    edit = editing.set_in_text
    monkeypatch.setattr(editing, "set_in_text", lambda text, *args: edit(text, *args) + "\n[cache]\nttl_s = 5.0\n")
    with pytest.raises(Invalid, match=r"would also change cache\.ttl_s"):
        set_value(home, "gateway.max_body_bytes", "4096", environ={})
    assert home.settings_file.read_text() == "[gateway]\nport = 8443\n"
