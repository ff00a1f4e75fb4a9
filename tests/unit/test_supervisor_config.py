"""The supervisord config: private socket, group signalling, escaped values."""

import configparser
from pathlib import Path

import pytest

from appliance.errors import SupervisorError
from appliance.home import Home
from appliance.programs import Program
from appliance.supervisor import render_config


def test_config_parses_and_keeps_processes_in_groups(tmp_path: Path) -> None:
    home = Home(tmp_path)
    program = Program(name="vllm-main", command=["python", "-m", "x", "--name", "a b", "50%"],
                      environment={"B": "2"}, port=8100, startsecs=10)
    text = render_config(home, [program], password="pw")
    parser = configparser.RawConfigParser()
    parser.read_string(text)
    section = parser["program:vllm-main"]
    assert section["stopasgroup"] == "true" and section["killasgroup"] == "true"
    assert section["autorestart"] == "true" and section["startsecs"] == "10"
    assert section["command"] == "python -m x --name 'a b' 50%%"
    assert section["stdout_logfile"] == str(home.logs / "vllm-main.log")
    assert parser["unix_http_server"]["chmod"] == "0700"
    assert parser["unix_http_server"]["file"] == str(home.run / "supervisor.sock")
    assert "inet_http_server" not in parser, "supervisord must not listen on TCP"


def test_environment_round_trips_through_supervisors_parser(tmp_path: Path) -> None:
    from supervisor.datatypes import dict_of_key_value_pairs

    env = {"KEY": 'va"l%ue\\x', "B": "2", "C": "a,b c", "D": "it's", "E": ""}
    text = render_config(Home(tmp_path), [Program(name="p", command=["true"], environment=env)], "pw")
    parser = configparser.ConfigParser()  # interpolating, as supervisord reads it
    parser.read_string(text)
    assert dict_of_key_value_pairs(parser["program:p"]["environment"]) == env


@pytest.mark.parametrize("value", ['"both\'', '"lead', "trail'"])
def test_environment_supervisor_cannot_carry_is_refused(tmp_path: Path, value: str) -> None:
    with pytest.raises(SupervisorError, match="environment variable K"):
        render_config(Home(tmp_path), [Program(name="p", command=["true"], environment={"K": value})], "pw")
