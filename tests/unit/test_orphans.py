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

from appliance.orphans import boot_id, end_leftovers, pgid_file

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
