"""Leftover-process cleanup acts only on the group it recorded: not on a record from
another boot, and not on a group id another program now holds."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from appliance.orphans import (
    boot_id,
    end_leftovers,
    end_starting,
    mark_starting,
    pgid_file,
    restore_priority,
    starting_file,
    up_is_starting,
)

pytestmark = pytest.mark.integration  # every test here starts processes


def sleeper_group() -> subprocess.Popen:
    """A process leading a group of its own, with a child in it (an engine and its worker)."""
    return subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                             "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"],
                            start_new_session=True)


def record(run: Path, leader: subprocess.Popen, *, boot: str | None = None, started: float | None = None) -> None:
    created = psutil.Process(leader.pid).create_time() if started is None else started
    pgid_file(run, "vllm-main").write_text(f"{leader.pid} {boot or boot_id()} {created:.3f}\n")


def end(leader: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(leader.pid, signal.SIGKILL)
    leader.wait()


def test_a_recorded_group_is_ended(tmp_path: Path) -> None:
    leader = sleeper_group()
    try:
        time.sleep(1)  # its worker has started
        record(tmp_path, leader)
        ended = end_leftovers(tmp_path)
        assert leader.pid in ended and len(ended) == 2
        assert not pgid_file(tmp_path, "vllm-main").exists()
    finally:
        end(leader)


def test_a_record_from_another_boot_or_another_group_is_left_alone(tmp_path: Path) -> None:
    leader = sleeper_group()
    try:
        time.sleep(1)
        record(tmp_path, leader, boot="00000000-0000-0000-0000-000000000000")
        assert end_leftovers(tmp_path) == [] and leader.poll() is None, "a record from another boot"
        record(tmp_path, leader, started=psutil.Process(leader.pid).create_time() - 3600)
        assert end_leftovers(tmp_path) == [] and leader.poll() is None, "the id now names another group"
        pgid_file(tmp_path, "vllm-main").write_text(f"{leader.pid}\n")  # the old format, no start time
        assert end_leftovers(tmp_path) == [] and leader.poll() is None
    finally:
        end(leader)


def wrapped(run: Path, *options: str, out: Path) -> subprocess.Popen:
    """A program started through the wrapper, reporting its niceness and a thread's."""
    report = ("import os, threading, time; t = threading.Thread(target=time.sleep, args=(60,)); t.start(); "
              f"open({str(out)!r}, 'w').write(f'{{os.getpid()}} {{t.native_id}} {{os.nice(0)}}'); time.sleep(60)")
    return subprocess.Popen([sys.executable, "-m", "appliance.orphans", "keycloak", str(run), *options, "--",
                             sys.executable, "-c", report], start_new_session=True)


def reported(out: Path) -> tuple[int, int, int]:
    deadline = time.monotonic() + 30
    while not out.exists() or len(out.read_text().split()) < 3:
        assert time.monotonic() < deadline, "the wrapped program never reported"
        time.sleep(0.05)
    pid, thread, nice = map(int, out.read_text().split())
    return pid, thread, nice


def thread_nice(pid: int, thread: int) -> int:
    return int(Path(f"/proc/{pid}/task/{thread}/stat").read_text().rsplit(")", 1)[1].split()[16])


def test_a_program_starts_niced_only_while_up_is_starting_and_is_restored(tmp_path: Path) -> None:
    mark_starting(tmp_path)  # this process plays `up`
    assert up_is_starting(tmp_path)
    program = wrapped(tmp_path, "--nice", "7", out=tmp_path / "niced")
    try:
        pid, thread, nice = reported(tmp_path / "niced")
        assert nice == 7 and thread_nice(pid, thread) == 7, "the program and its threads start niced"
        end_starting(tmp_path)
        if os.geteuid() == 0:
            assert restore_priority(tmp_path, "keycloak") is None
            assert psutil.Process(pid).nice() == 0 and thread_nice(pid, thread) == 0, "every thread restored"
    finally:
        end(program)
    # A restart by supervisord once `up` is done (no mark) starts at normal priority.
    program = wrapped(tmp_path, "--nice", "7", out=tmp_path / "restarted")
    try:
        assert reported(tmp_path / "restarted")[2] == 0
    finally:
        end(program)


def test_a_stale_start_mark_lowers_no_priority(tmp_path: Path) -> None:
    """`up` killed before it could clear its mark: the mark names a process that is gone (or a
    pid now another's), so later starts are at normal priority."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    starting_file(tmp_path).write_text(f"{dead.pid} {boot_id()} {time.time() - 5:.3f}\n")
    assert not up_is_starting(tmp_path)
    starting_file(tmp_path).write_text(f"{os.getpid()} {boot_id()} 12.000\n")  # the pid, another start time
    assert not up_is_starting(tmp_path)
    starting_file(tmp_path).write_text("garbage\n")
    assert not up_is_starting(tmp_path)
    program = wrapped(tmp_path, "--nice", "7", out=tmp_path / "out")
    try:
        assert reported(tmp_path / "out")[2] == 0
    finally:
        end(program)


def test_a_refused_restore_is_said(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    leader = sleeper_group()
    try:
        record(tmp_path, leader)
        os.rename(pgid_file(tmp_path, "vllm-main"), pgid_file(tmp_path, "keycloak"))

        def refuse(which: int, who: int, value: int) -> None:
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(os, "setpriority", refuse)
        assert "needs root or CAP_SYS_NICE" in (restore_priority(tmp_path, "keycloak") or "")
        assert restore_priority(tmp_path, "not-running") is None
    finally:
        end(leader)


@pytest.mark.parametrize("options", [["--nice", "x"], ["--nice", "-3"], ["--nice"], ["--nice", "1", "--nice", "2"]])
def test_bad_wrapper_options_are_refused(tmp_path: Path, options: list[str]) -> None:
    refused = subprocess.run([sys.executable, "-m", "appliance.orphans", "keycloak", str(tmp_path), *options, "--",
                              "true"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "usage:" in refused.stderr
