"""The `appliance` command: --help everywhere, one-line errors with a non-zero exit."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from appliance import cli
from tests.support.appliances import APPLIANCE, Appliance, make_appliance


def all_command_paths() -> list[list[str]]:
    cli._register_package_commands()
    root = typer.main.get_command(cli.app)
    paths: list[list[str]] = []

    def walk(command: object, path: list[str]) -> None:
        paths.append(path)
        if hasattr(command, "commands"):
            for name, sub in command.commands.items():
                walk(sub, [*path, name])

    walk(root, [])
    return paths


def test_every_command_has_help() -> None:
    paths = all_command_paths()
    for expected in (["up"], ["down"], ["status"], ["token"], ["users", "add"], ["model", "prepare-demo"],
                     ["keycloak", "install"]):
        assert expected in paths
    runner = CliRunner()
    for path in paths:
        result = runner.invoke(cli.app, [*path, "--help"])
        assert result.exit_code == 0, (path, result.output)
        assert "Usage:" in result.output


@pytest.fixture
def appliance() -> Appliance:
    yield from make_appliance(None)


def test_bad_settings_is_one_line_and_exit_1(appliance: Appliance) -> None:
    appliance.home.settings_file.write_text("[engine]\nmax_model_len = 0\n")
    result = appliance.run("up", timeout=60)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"{appliance.home.settings_file}:2: engine.max_model_len" in lines[0]
    assert "greater than 0" in lines[0]


def test_unknown_command_is_a_usage_error(appliance: Appliance) -> None:
    result = appliance.run("upp", timeout=60)
    assert result.returncode == 2
    assert "No such command" in result.stderr


def test_console_script_is_installed() -> None:
    assert Path(APPLIANCE).is_file()
