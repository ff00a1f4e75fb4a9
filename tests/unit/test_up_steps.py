"""The step record of `up`: written after each step, read guardedly; an `up` that finds steps
left does exactly those, and only one `up` runs at a time. (A real `up` killed half-way and
finished by the next: tests/integration/test_lifecycle_resume.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from appliance import lifecycle
from appliance.errors import Conflict
from appliance.home import Home
from appliance.programs import Program
from appliance.up_steps import (
    STEPS,
    UpSteps,
    forget_steps,
    read_steps,
    record_steps,
    steps_file,
    up_lock,
    up_running,
)


def test_the_record_keeps_the_steps_done_privately(home: Home) -> None:
    assert read_steps(home) is None
    for count in range(len(STEPS) + 1):
        record_steps(home, UpSteps(STEPS[:count]))
        assert read_steps(home) == UpSteps(STEPS[:count])
        assert steps_file(home).stat().st_mode & 0o777 == 0o600
    assert read_steps(home) is not None and not read_steps(home).left  # type: ignore[union-attr]
    forget_steps(home)
    assert read_steps(home) is None


@pytest.mark.parametrize("text", [
    "", "not json", "[]", "{}", '{"done": "supervisord"}', '{"done": [1]}', '{"done": ["ready"]}',
    '{"done": ["supervisord", "provisioned"]}', '{"done": ["supervisord", "supervisord"]}',
    '{"done": ["supervisord", "ready", "priority", "provisioned", "more"]}', '{"done": []}' + " " * 5000,
])
def test_a_record_that_is_not_a_start_of_the_steps_is_unknown(home: Home, text: str) -> None:
    """Unknown means every step is done again: never taken for an appliance fully up."""
    steps_file(home).write_text(text)
    assert read_steps(home) is None


def test_a_link_is_not_followed(home: Home, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"done": list(STEPS)}))
    steps_file(home).symlink_to(target)
    assert read_steps(home) is None


@pytest.mark.parametrize("done", [("ready",), ("supervisord", "priority"), (*STEPS, "supervisord")])
def test_steps_out_of_order_are_refused(done: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="not a start of"):
        UpSteps(done)


def test_one_up_at_a_time_and_a_killed_one_holds_nothing(home: Home) -> None:
    assert not up_running(home)
    with up_lock(home):
        assert up_running(home)
        with pytest.raises(Conflict, match="another `appliance up`"), up_lock(home):
            pass
    assert not up_running(home)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from appliance.home import Home; from appliance.up_steps import up_lock; "
                               "lock = up_lock(Home(Path(sys.argv[1]))); "
                               "lock.__enter__(); print('held', flush=True); time.sleep(60)", str(home.root)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert up_running(home)
        os.kill(holder.pid, signal.SIGKILL)
    finally:
        holder.kill()
        holder.wait()
    assert not up_running(home), "the kernel released a killed `up`'s lock"
    with up_lock(home):
        pass


class FakeSupervisor:
    """supervisord running, as an `up` killed half-way left it."""

    stopped = False

    def __init__(self, home: Home) -> None:
        self.home = home

    def is_running(self) -> bool:
        return not FakeSupervisor.stopped

    def shutdown(self) -> None:
        FakeSupervisor.stopped = True


@pytest.fixture
def killed_up(home: Home, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[str, ...]]]:
    """An appliance whose supervisord runs one program started at a low priority; the steps after
    `supervisord` replaced by ones that note themselves and the steps recorded when each began."""
    home.ensure()
    program = Program(name="watchdog", command=["true"], start_nice=19)
    (home.run / "programs.json").write_text(json.dumps([program.model_dump(mode="json")]))
    FakeSupervisor.stopped = False
    monkeypatch.setattr(lifecycle, "Supervisor", FakeSupervisor)
    calls: list[tuple[str, tuple[str, ...]]] = []

    def note(step: str, result: Any) -> Any:
        def fake(*args: Any, **kwargs: Any) -> Any:
            recorded = read_steps(home)
            calls.append((step, recorded.done if recorded else ()))
            return result
        return fake

    monkeypatch.setattr(lifecycle, "wait_ready", note("ready", {"watchdog": 1.0}))
    monkeypatch.setattr(lifecycle, "restore_priority", note("priority", None))
    monkeypatch.setattr(lifecycle, "run_provisioners", note("provisioned", ["bootstrap admin user 'admin' created"]))
    return calls


@pytest.mark.parametrize("killed_after", range(1, len(STEPS)))
def test_an_up_finishes_exactly_the_steps_left_each_recorded_before_the_next(
        home: Home, killed_up: list[tuple[str, tuple[str, ...]]], killed_after: int) -> None:
    record_steps(home, UpSteps(STEPS[:killed_after]))
    report = lifecycle.up(None, home)  # type: ignore[arg-type]  # the fakes need no settings
    left = STEPS[killed_after:]
    assert not report.already_up and report.finished == left
    assert [step for step, _ in killed_up] == list(left)
    assert all(done == STEPS[:STEPS.index(step)] for step, done in killed_up), "each began once the last was recorded"
    assert read_steps(home) == UpSteps(STEPS)
    assert ("provisioned" in left) == ("bootstrap admin user 'admin' created" in report.notices)
    killed_up.clear()
    assert lifecycle.up(None, home).already_up and not killed_up  # type: ignore[arg-type]


def test_an_older_versions_appliance_has_every_step_done_again(
        home: Home, killed_up: list[tuple[str, tuple[str, ...]]]) -> None:
    """It recorded no steps: nothing says its `up` finished."""
    report = lifecycle.up(None, home)  # type: ignore[arg-type]
    assert [step for step, _ in killed_up] == ["ready", "priority", "provisioned"]
    assert report.finished == STEPS[1:] and read_steps(home) == UpSteps(STEPS)


def test_finishing_that_fails_stops_the_appliance(home: Home, killed_up: list[tuple[str, tuple[str, ...]]],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*args: Any) -> list[str]:
        raise RuntimeError("Keycloak refused provisioning")

    monkeypatch.setattr(lifecycle, "run_provisioners", refused)
    monkeypatch.setattr(lifecycle, "end_leftovers", lambda run: [])
    record_steps(home, UpSteps(STEPS[:2]))
    with pytest.raises(RuntimeError, match="refused"):
        lifecycle.up(None, home)  # type: ignore[arg-type]
    assert FakeSupervisor.stopped and read_steps(home) is None, "down, and no `up` left to finish"


def test_a_second_up_while_one_runs_is_refused(home: Home, killed_up: list[tuple[str, tuple[str, ...]]]) -> None:
    record_steps(home, UpSteps(STEPS[:1]))
    with up_lock(home), pytest.raises(Conflict):
        lifecycle.up(None, home)  # type: ignore[arg-type]
    assert not killed_up and read_steps(home) == UpSteps(STEPS[:1])
