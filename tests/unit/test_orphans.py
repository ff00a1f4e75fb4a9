"""Leftover-process cleanup acts only on the group it recorded: not on a record from
another boot, and not on a group id another program now holds; and it knows its groups whatever
the wall clock did since (a start is the kernel's ticks since boot, not a wall-clock time)."""

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
from hypothesis import given
from hypothesis import strategies as st

from appliance.orphans import (
    Recorded,
    boot_id,
    end_leftovers,
    end_starting,
    group_started,
    identify,
    mark_starting,
    parse_record,
    pgid_file,
    recorded_members,
    restore_priority,
    start_ticks,
    starting_file,
    still_running,
    up_is_starting,
)
from tests.support.stepped_clock import stepped_clock
from tests.support.waiting import until

pytestmark = pytest.mark.integration  # every test here starts processes


def sleeper_group() -> subprocess.Popen[bytes]:
    """A process leading a group of its own, with a child in it (an engine and its worker); both
    sleep, so that they run until the test ends them."""
    return subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                             "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"],
                            start_new_session=True)


def record(run: Path, leader: subprocess.Popen[bytes], *, boot: str | None = None, ticks: int | None = None) -> str:
    """Record `leader`'s group as the wrapper does (another boot, or another start, if given)."""
    line = Recorded(leader.pid, boot or boot_id(), start_ticks(leader.pid) if ticks is None else ticks).line()
    pgid_file(run, "vllm-main").write_text(line)
    return line


def legacy_record(run: Path, leader: subprocess.Popen[bytes], started: float) -> None:
    """A record as versions before ticks wrote it: the leader's wall-clock start."""
    pgid_file(run, "vllm-main").write_text(f"{leader.pid} {boot_id()} {started:.3f}\n")


def with_worker(leader: subprocess.Popen[bytes]) -> list[int]:
    """The leader and its worker, once the worker runs."""
    children = until(psutil.Process(leader.pid).children, "the worker to start", 30)
    return [leader.pid, *(child.pid for child in children)]


def end(leader: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(leader.pid, signal.SIGKILL)
    leader.wait()


def test_a_recorded_group_is_ended(tmp_path: Path) -> None:
    leader = sleeper_group()
    try:
        group = with_worker(leader)
        record(tmp_path, leader)
        ended = end_leftovers(tmp_path)
        assert sorted(ended) == sorted(group)
        assert not pgid_file(tmp_path, "vllm-main").exists()
    finally:
        end(leader)


def test_a_record_from_another_boot_or_another_group_is_left_alone(tmp_path: Path) -> None:
    leader = sleeper_group()
    try:
        with_worker(leader)
        record(tmp_path, leader, boot="00000000-0000-0000-0000-000000000000")
        assert end_leftovers(tmp_path) == [] and leader.poll() is None, "a record from another boot"
        record(tmp_path, leader, ticks=start_ticks(leader.pid) - 1)
        assert end_leftovers(tmp_path) == [] and leader.poll() is None, "the id now names another group"
        boot = boot_id()
        for malformed in (f"{leader.pid}\n", f"{leader.pid} {boot} ticks:x\n", f"{leader.pid} {boot} ticks:-1\n",
                          f"-{leader.pid} {boot} ticks:1\n", ""):
            pgid_file(tmp_path, "vllm-main").write_text(malformed)
            assert end_leftovers(tmp_path) == [] and leader.poll() is None, malformed
    finally:
        end(leader)


SHIFTS = st.floats(min_value=-10 * 365 * 86400, max_value=10 * 365 * 86400, allow_nan=False)


def test_records_know_their_processes_however_the_clock_steps(tmp_path: Path) -> None:
    """A group recorded before the clock stepped, any size either way, is still known after it, its
    worker too; and so is the `up` that marked the run directory."""
    leader = sleeper_group()
    try:
        group = with_worker(leader)
        line = record(tmp_path, leader)
        mark_starting(tmp_path)

        @given(seconds=SHIFTS)
        def still_known(seconds: float) -> None:
            with stepped_clock(seconds):
                assert sorted(p.pid for p in recorded_members(line)) == sorted(group)
                assert identify(leader.pid).line() == line, "the record written now is the same"
                assert up_is_starting(tmp_path)

        still_known()
    finally:
        end(leader)


TICKS = st.integers(min_value=0, max_value=2**63)


def never_asked() -> float:
    raise AssertionError("a record in ticks is never compared with the wall clock")


@given(pid=st.integers(min_value=1, max_value=2**22), recorded=TICKS, now=TICKS, seconds=SHIFTS)
def test_the_same_pid_and_start_is_the_same_process_and_nothing_else_is(pid: int, recorded: int, now: int,
                                                                        seconds: float) -> None:
    """Same pid and start ticks: the recorded group; the pid with another start: a reused id, not
    ours; the leader gone: its workers that started no earlier are; another boot: nothing. The
    wall clock (stepped by `seconds`) takes no part."""
    boot = "b"
    line = Recorded(pid, boot, recorded).line()
    with stepped_clock(seconds):
        found = parse_record(line)
        assert found == Recorded(pid, boot, recorded)
        assert group_started(found, boot, recorded, never_asked) == recorded
        assert group_started(found, boot, now, never_asked) == (recorded if now == recorded else None)
        assert group_started(found, boot, None, never_asked) == recorded
        assert group_started(found, "another boot", recorded, never_asked) is None


@pytest.mark.parametrize(("leader_alive", "clock_error_s", "trusted"), [
    (True, 0.0, True),  # the older version's rule: the same start by the wall clock
    (True, 0.005, True),
    (True, 44.0, False),  # the clock stepped since it was written: unknown, so left alone
    (True, -44.0, False),
    (False, 0.0, False),  # its leader is gone: its workers cannot be told from another group's
])
def test_an_older_versions_record_is_trusted_only_as_far_as_it_can_be(leader_alive: bool, clock_error_s: float,
                                                                      trusted: bool) -> None:
    found = parse_record("4242 b 1700000000.250")
    assert found == Recorded(4242, "b", wall=1700000000.25)
    started = group_started(found, "b", 777 if leader_alive else None, lambda: 1700000000.25 + clock_error_s)
    assert started == (777 if trusted else None)


def test_an_older_versions_record_ends_its_group_only_while_its_leader_runs(tmp_path: Path) -> None:
    """The upgrade path: what the older version recorded is still ended by `up` and `down`."""
    leader = sleeper_group()
    try:
        group = with_worker(leader)
        legacy_record(tmp_path, leader, psutil.Process(leader.pid).create_time())
        assert sorted(end_leftovers(tmp_path)) == sorted(group)
    finally:
        end(leader)
    leader = sleeper_group()
    try:
        with_worker(leader)
        os.kill(leader.pid, signal.SIGKILL)  # the leader died hard; its worker runs on
        leader.wait()
        legacy_record(tmp_path, leader, time.time())
        assert end_leftovers(tmp_path) == [], "without its leader, nothing tells whose worker it is"
    finally:
        end(leader)


def wrapped(run: Path, *options: str, out: Path) -> subprocess.Popen[bytes]:
    """A program started through the wrapper, reporting its niceness and a thread's (then asleep,
    running until the test ends it)."""
    report = ("import os, threading, time; t = threading.Thread(target=time.sleep, args=(60,)); t.start(); "
              f"open({str(out)!r}, 'w').write(f'{{os.getpid()}} {{t.native_id}} {{os.nice(0)}}'); time.sleep(60)")
    return subprocess.Popen([sys.executable, "-m", "appliance.orphans", "keycloak", str(run), *options, "--",
                             sys.executable, "-c", report], start_new_session=True)


def reported(out: Path) -> tuple[int, int, int]:
    """What the wrapped program reported, once it has written it whole."""

    def whole() -> list[str] | None:
        words = out.read_text().split() if out.exists() else []
        return words if len(words) >= 3 else None

    pid, thread, nice = map(int, until(whole, "the wrapped program to report", 30))
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
    starting_file(tmp_path).write_text(Recorded(dead.pid, boot_id(), 1).line())
    assert not up_is_starting(tmp_path)
    starting_file(tmp_path).write_text(Recorded(os.getpid(), boot_id(), start_ticks(os.getpid()) + 1).line())
    assert not up_is_starting(tmp_path), "the pid, another start"
    starting_file(tmp_path).write_text(f"{os.getpid()} {boot_id()} {psutil.Process().create_time():.3f}\n")
    assert not up_is_starting(tmp_path), "an older version's mark: that `up` was replaced"
    assert still_running(identify(os.getpid()).line())
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
