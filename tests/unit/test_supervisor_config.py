"""The supervisord config: private socket, group signalling, escaped values; restart counts from
supervisord's log."""

import configparser

import pytest

from appliance.errors import SupervisorError
from appliance.home import Home
from appliance.programs import Program
from appliance.supervisor import Supervisor, render_config


def test_config_parses_and_keeps_processes_in_groups(home: Home) -> None:
    program = Program(name="vllm-main", command=["python", "-m", "x", "--name", "a b", "50%"],
                      environment={"B": "2"}, port=8100, startsecs=10)
    text = render_config(home, [program], password="pw")
    parser = configparser.RawConfigParser()
    parser.read_string(text)
    section = parser["program:vllm-main"]
    assert section["stopasgroup"] == "true" and section["killasgroup"] == "true" and section["stopsignal"] == "TERM"
    assert section["autorestart"] == "true" and section["startsecs"] == "10"
    assert section["command"] == "python -m x --name 'a b' 50%%"
    assert section["stdout_logfile"] == str(home.logs / "vllm-main.log")
    assert parser["unix_http_server"]["chmod"] == "0700"
    assert parser["unix_http_server"]["file"] == str(home.run / "supervisor.sock")
    assert "inet_http_server" not in parser, "supervisord must not listen on TCP"
    assert parser["supervisord"]["umask"] == "077", "what supervisord and its programs make is theirs alone"


def test_environment_round_trips_through_supervisors_parser(home: Home) -> None:
    from supervisor.datatypes import dict_of_key_value_pairs

    env = {"KEY": 'va"l%ue\\x', "B": "2", "C": "a,b c", "D": "it's", "E": ""}
    text = render_config(home, [Program(name="p", command=["true"], environment=env)], "pw")
    parser = configparser.ConfigParser()  # interpolating, as supervisord reads it
    parser.read_string(text)
    assert dict_of_key_value_pairs(parser["program:p"]["environment"]) == env


@pytest.mark.parametrize("value", ['"both\'', '"lead', "trail'"])
def test_environment_supervisor_cannot_carry_is_refused(home: Home, value: str) -> None:
    with pytest.raises(SupervisorError, match="environment variable K"):
        render_config(home, [Program(name="p", command=["true"], environment={"K": value})], "pw")


def test_restarts_are_counted_from_the_log_as_it_grows_and_after_rotation(home: Home) -> None:
    log = home.logs / "supervisord.log"

    def spawn(name: str, pid: int) -> str:
        return f"2026-11-30 10:00:00,000 INFO spawned: '{name}' with pid {pid}\n"

    log.write_text(spawn("gateway", 1) + spawn("keycloak", 2) + "2026 INFO success: gateway entered RUNNING\n")
    assert Supervisor(home).restarts() == {"gateway": 0, "keycloak": 0}
    with log.open("a") as out:
        out.write(spawn("gateway", 3) + spawn("gateway", 4) + "2026-11-30 10:00:01,000 INFO spawned: 'keyc")
    assert Supervisor(home).restarts() == {"gateway": 2, "keycloak": 0}, "a half-written line waits"
    with log.open("a") as out:
        out.write("loak' with pid 5\n")
    assert Supervisor(home).restarts() == {"gateway": 2, "keycloak": 1}
    log.rename(log.with_suffix(".log.1"))  # supervisord rotates its log: counting starts again
    log.write_text(spawn("gateway", 6))
    assert Supervisor(home).restarts() == {"gateway": 0}


def test_a_program_may_be_stopped_by_another_signal(home: Home) -> None:
    """PostgreSQL's fast shutdown is SIGINT; SIGTERM would wait for every client to leave."""
    program = Program(name="postgres", command=["postgres"], stop_signal="INT")
    parser = configparser.RawConfigParser()
    parser.read_string(render_config(home, [program], password="pw"))
    assert parser["program:postgres"]["stopsignal"] == "INT"
