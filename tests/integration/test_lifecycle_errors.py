"""`appliance up` refuses, with one line and the log to read, what cannot start."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.support.appliances import Appliance, make_appliance


@pytest.fixture
def with_model(demo_model: Path) -> Iterator[Appliance]:
    yield from make_appliance(demo_model)


@pytest.fixture
def without_model() -> Iterator[Appliance]:
    yield from make_appliance(None)


def one_error_line(result) -> str:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def assert_down(appliance: Appliance) -> None:
    status = appliance.run("status")
    assert "down" in status.stdout, status.stdout


def test_taken_port_is_refused_before_anything_starts(with_model: Appliance) -> None:
    port = int(with_model.env["APPLIANCE_GATEWAY__PORT"])
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        line = one_error_line(with_model.run("up"))
    assert f"gateway: port {port} is already in use (by pid " in line
    assert f"log: {with_model.home.logs / 'appliance.log'}" in line
    assert line.split("error: ", 1)[1] in (with_model.home.logs / "appliance.log").read_text()
    assert_down(with_model)


def test_missing_model_is_refused(without_model: Appliance) -> None:
    line = one_error_line(without_model.run("up"))
    assert "vllm-main: model not found" in line and "prepare-demo" in line
    assert "log: " in line
    assert_down(without_model)


def test_engine_that_fails_to_start_is_reported_and_cleaned_up(demo_model: Path) -> None:
    # The demo model allows 8192 positions; vLLM refuses a longer --max-model-len at start.
    for appliance in make_appliance(demo_model, APPLIANCE_ENGINE__MAX_MODEL_LEN="999999"):
        line = one_error_line(appliance.run("up"))
        log = appliance.home.logs / "vllm-main.log"
        assert "vllm-main exited during start:" in line
        assert "max_model_len" in line
        assert f"log: {log}" in line
        assert_down(appliance)
        leftovers = [p for p in psutil.process_iter(["cmdline"])
                     if str(appliance.home.root) in " ".join(p.info["cmdline"] or [])]
        assert not leftovers
