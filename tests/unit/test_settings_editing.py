"""One setting written into the settings file's text: the value replaced in place with the line's
comment kept, or a line added where TOML puts it; anything that would change another setting is
refused."""

from __future__ import annotations

import tomllib

import pytest

from appliance.errors import SettingsError
from appliance.settings.editing import render_value, set_in_text


def test_a_value_with_a_hash_inside_keeps_the_comment_after_it() -> None:
    text = '[gateway]  # the front door\npublic_url = "https://a/#x"  # old\n'
    edited = set_in_text(text, ["gateway", "public_url"], "https://b/#y", "f")
    assert edited == '[gateway]  # the front door\npublic_url = "https://b/#y"  # old\n'


def test_a_key_written_dotted_before_any_table_is_replaced_there() -> None:
    text = "gateway.port = 8443\n\n[engine]\nmax_model_len = 2048\n"
    assert set_in_text(text, ["gateway", "port"], 9443, "f") == text.replace("8443", "9443")


def test_the_deepest_table_holding_the_key_gets_the_line() -> None:
    text = "[gateway]\nport = 8443\n\n[gateway.limits.user]\nrequests_per_minute = 5\n# end\n"
    edited = set_in_text(text, ["gateway", "limits", "user", "tokens_per_minute"], 100, "f")
    assert edited == text.replace("requests_per_minute = 5\n", "requests_per_minute = 5\ntokens_per_minute = 100\n")


def test_a_pool_is_found_by_its_name_among_several() -> None:
    text = '[[pools]]\nname = "main"\n\n[[pools]]\nname = "code"\nmax_loras = 2\n'
    edited = set_in_text(text, ["pools", "code", "max_loras"], 8, "f")
    assert tomllib.loads(edited)["pools"] == [{"name": "main"}, {"name": "code", "max_loras": 8}]


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\x85"])
def test_a_line_separator_inside_a_string_does_not_split_its_line(separator: str) -> None:
    # TOML ends lines at LF or CRLF only: a value holding another separator is one line, kept whole
    text = f'[gateway]\nport = 8443\n\n[[pools]]\nname = "main"\nmodel = "a{separator}b"  # x{separator}y\n'
    assert set_in_text(text, ["gateway", "port"], 9443, "f") == text.replace("8443", "9443")
    edited = set_in_text(text, ["pools", "main", "model"], f"c{separator}d", "f")
    assert tomllib.loads(edited)["pools"][0]["model"] == f"c{separator}d" and edited.endswith(f"# x{separator}y\n")


def test_a_file_with_crlf_line_ends_is_edited_in_place() -> None:
    text = "[gateway]\r\nport = 8443  # ours\r\nbind = \"127.0.0.1\"\r\n"
    assert set_in_text(text, ["gateway", "port"], 9443, "f") == "[gateway]\nport = 9443  # ours\nbind = \"127.0.0.1\"\n"


def test_a_key_inside_an_inline_table_is_refused() -> None:
    text = "[gateway]\nlimits = { user = { requests_per_minute = 5 } }\n"
    with pytest.raises(SettingsError, match="f: gateway.limits.user.requests_per_minute: the file's layout"):
        set_in_text(text, ["gateway", "limits", "user", "requests_per_minute"], 6, "f")


def test_values_render_on_one_line() -> None:
    assert render_value({"a b": [1, "x"], "c": True}) == '{ "a b" = [1, "x"], c = true }'
    assert render_value(1.5) == "1.5" and render_value('say "hi"') == '"say \\"hi\\""'
