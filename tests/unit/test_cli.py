"""The `appliance` command: --help everywhere, one-line errors with a non-zero exit."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import typer
from typer.testing import CliRunner

from appliance import cli
from appliance.home import Home
from tests.support.appliances import APPLIANCE, Appliance, make_appliance


def all_command_paths() -> list[list[str]]:
    paths: list[list[str]] = [[]]

    def walk(command: object, path: list[str]) -> None:
        paths.append(path)
        if hasattr(command, "commands"):
            for name, sub in command.commands.items():
                walk(sub, [*path, name])

    for name, target in cli.command_targets().items():
        walk(cli.load_command(name, target), [name])
    return paths


def test_every_command_has_help() -> None:
    paths = all_command_paths()
    for expected in (["up"], ["down"], ["status"], ["token"], ["users", "add"], ["model", "prepare-demo"],
                     ["keycloak", "install"], ["hosts", "add"], ["join"], ["serving", "pools"]):
        assert expected in paths
    runner = CliRunner()
    for path in paths:
        result = runner.invoke(cli.app, [*path, "--help"])
        assert result.exit_code == 0, (path, result.output)
        assert "Usage:" in result.output


def test_the_root_lists_each_command_by_the_first_words_of_its_own_help() -> None:
    """`appliance --help` imports no command: its summaries must say what each command's help says."""
    listed = typer.main.get_command(cli.app)
    assert listed.list_commands(typer.Context(listed)) == list(cli.command_targets())
    for name, target in cli.command_targets().items():
        command = cli.load_command(name, target)
        own = " ".join((command.help or "").split())
        assert cli.SUMMARIES.get(name), f"{name}: add its one-line summary to appliance.cli.SUMMARIES"
        assert own.startswith(cli.SUMMARIES[name]), (name, own)


@pytest.fixture
def appliance() -> Appliance:
    yield from make_appliance(None)


@pytest.mark.integration
def test_bad_settings_is_one_line_and_exit_1(appliance: Appliance) -> None:
    appliance.home.settings_file.write_text("[engine]\nmax_model_len = 0\n")
    result = appliance.run("up", timeout=60)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"{appliance.home.settings_file}:2: engine.max_model_len" in lines[0]
    assert "greater than 0" in lines[0]


@pytest.mark.integration
def test_unknown_command_is_a_usage_error(appliance: Appliance) -> None:
    result = appliance.run("upp", timeout=60)
    assert result.returncode == 2
    assert "No such command" in result.stderr


@pytest.mark.integration
def test_console_script_is_installed() -> None:
    """The installed `appliance` script runs the app, with every package's commands registered."""
    shown = subprocess.run([APPLIANCE, "--help"], capture_output=True, text=True, timeout=120, check=False,
                           env={**os.environ, "COLUMNS": "200"})
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.lstrip().startswith("Usage: appliance ")
    listed = set(re.findall(r"^\W+([a-z][a-z-]*)  ", shown.stdout, re.MULTILINE))
    by_package = {"appliance": {"up", "down", "status", "users", "adapters"}, "serve": {"hosts", "join"},
                  "installer": {"profile", "preflight", "plan", "stage", "bundle", "keycloak"},
                  "finetune": {"data", "finetune", "rl"}, "audit": {"audit"}, "tui": {"tui"}}
    missing = {package: names - listed for package, names in by_package.items() if names - listed}
    assert not missing, shown.stdout


def test_json_is_the_answer_whole_and_nothing_else(monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from appliance.commands import users

    answer = [{"username": "alice", "enabled": True, "roles": ["user"]}]
    monkeypatch.setattr(users, "admin_api", lambda method, path, **_: answer)
    shown = CliRunner().invoke(cli.app, ["users", "list", "--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout) == answer


def test_no_python_repr_reaches_the_reader(home: Home) -> None:
    """An unknown dataset's hint names the datasets as words, not as a Python list."""
    from appliance.datasets import register
    from appliance.errors import ApplianceError
    from appliance.jobs import Hyperparameters
    from finetune import cli as finetune_cli

    register(home, {"faq": "0" * 64, "support": "1" * 64})
    with pytest.raises(ApplianceError) as caught:
        finetune_cli._check("bot", "missing", "demo", home, Hyperparameters())
    assert caught.value.hint == "datasets: faq, support"


def test_the_routing_policy_names_tiers_only_where_pools_have_them() -> None:
    from appliance.commands.serving import policy_line

    policy = {"interactive_tier": "fast", "default_tier": "full", "long_prompt_chars": 8000, "balance": "affinity"}
    assert policy_line(policy, set()) == "policy: no pool has tiers; replicas balanced by affinity"
    assert "tier fast" in policy_line(policy, {"fast", "full"}) and "tier full" in policy_line(policy, {"fast", "full"})
