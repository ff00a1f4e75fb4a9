"""`up` and `down` on an appliance of its own (Keycloak, its PostgreSQL, vLLM serving the demo
model): an `up` killed half-way is finished by the next one, and the programs stay known to `up`
and `down` after the wall clock stepped while supervisord was gone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from appliance.secrets import secret
from appliance.settings import load_settings
from appliance.supervisor import pid_alive
from appliance.up_steps import STEPS, read_steps
from installer.realm import BOOTSTRAP_SECRET, BOOTSTRAP_USER, master_admin
from tests.support.appliances import APPLIANCE, Appliance, make_appliance

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def appliance(demo_model: Path, keycloak_dist: Path) -> Iterator[Appliance]:
    yield from make_appliance(demo_model, keycloak_dist)


def status(appliance: Appliance) -> dict:
    result = appliance.run("status", "--json", timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def started(appliance: Appliance) -> None:
    """The appliance up, every step done (whatever a test before left)."""
    if status(appliance)["up"]["steps_left"] or not status(appliance)["supervisord"]["running"]:
        result = appliance.run("up")
        assert result.returncode == 0, result.stdout + result.stderr
    assert read_steps(appliance.home) is not None and not read_steps(appliance.home).left


def live(pids: list[int]) -> list[int]:
    return [pid for pid in pids if pid_alive(pid)]


def supervised_tree(appliance: Appliance) -> tuple[int, list[int]]:
    """supervisord's pid and every process under it."""
    daemon = status(appliance)["supervisord"]["pid"]
    return daemon, [p.pid for p in psutil.Process(daemon).children(recursive=True)]


def niced(pids: list[int]) -> dict[int, int]:
    """The processes and threads among `pids`' that run at a niceness other than 0."""
    found = {}
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                nice = int((task / "stat").read_text().rsplit(")", 1)[1].split()[16])
            except (OSError, ValueError):
                continue  # it ended meanwhile
            if nice:
                found[int(task.name)] = nice
    return found


def bootstrap_admin_exists(appliance: Appliance) -> bool:
    admin = master_admin(load_settings(appliance.home.settings_file, environ=appliance.env), appliance.home)
    realm = admin.connection.realm_name
    admin.connection.realm_name = "master"
    if realm not in {r["realm"] for r in admin.get_realms()}:
        return False
    admin.connection.realm_name = realm
    return admin.get_user_id(BOOTSTRAP_USER) is not None


def test_an_up_killed_half_way_is_finished_by_the_next(appliance: Appliance) -> None:
    assert appliance.run("down", timeout=300).returncode == 0
    output = appliance.home.root.parent / "first-up.txt"
    with output.open("w") as written:
        first = subprocess.Popen([APPLIANCE, "up"], env=appliance.env, stdout=written, stderr=subprocess.STDOUT)
    try:
        # Killed once every program answers, before the provisioners made the realm's administrator.
        deadline = time.monotonic() + 900
        while (steps := read_steps(appliance.home)) is None or "ready" not in steps.done:
            assert first.poll() is None, f"the first `up` ended before its programs were ready: {output.read_text()}"
            assert time.monotonic() < deadline, "the first `up` never recorded its programs ready"
            time.sleep(0.02)
    finally:
        first.kill()
        first.wait()
    assert not bootstrap_admin_exists(appliance), "killed too late: the provisioners had run"
    report = status(appliance)
    assert report["supervisord"]["running"] and "provisioned" in report["up"]["steps_left"]
    assert not report["up"]["running"]
    assert "`appliance up` did not finish" in appliance.run("status").stdout

    second = appliance.run("up")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "finished an interrupted `up`" in second.stdout and "already up" not in second.stdout
    assert f"bootstrap admin user '{BOOTSTRAP_USER}' created" in second.stdout
    assert bootstrap_admin_exists(appliance)
    login = appliance.run("token", "--user", BOOTSTRAP_USER, "--password-stdin",
                          stdin=secret(appliance.home, BOOTSTRAP_SECRET) + "\n", timeout=120)
    assert login.returncode == 0, login.stderr
    _, tree = supervised_tree(appliance)
    assert not niced(tree), "a program was left at the low priority it started at"
    assert read_steps(appliance.home) is not None and read_steps(appliance.home).done == STEPS
    assert status(appliance)["up"] == {"steps_left": [], "running": False}

    third = appliance.run("up")
    assert third.returncode == 0 and "already up; nothing changed" in third.stdout, third.stdout + third.stderr


def stepped(appliance: Appliance, seconds: float, *args: str) -> subprocess.CompletedProcess[str]:
    """The `appliance` command run with the wall clock stepped by `seconds` since the programs'
    records were written (tests.support.stepped_clock)."""
    return subprocess.run([sys.executable, "-m", "tests.support.stepped_clock", str(seconds), *args],
                          env={**appliance.env, "PYTHONPATH": str(ROOT)}, cwd=ROOT, capture_output=True,
                          text=True, timeout=900, check=False)


def kill_supervisord(appliance: Appliance) -> list[int]:
    """supervisord killed hard: every program it ran keeps running, re-parented. Their pids."""
    daemon, tree = supervised_tree(appliance)
    os.kill(daemon, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while pid_alive(daemon):
        assert time.monotonic() < deadline, "supervisord outlived SIGKILL"
        time.sleep(0.05)
    return tree


def gateway_answers(appliance: Appliance) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{appliance.port('APPLIANCE_GATEWAY__PORT')}/healthz", timeout=10).is_success
    except httpx.HTTPError:
        return False


def test_programs_are_known_after_the_clock_stepped_while_supervisord_was_gone(appliance: Appliance) -> None:
    """`up` ends what the dead supervisord left (a clock 44 s ahead), and so does `down` (an hour
    behind): neither takes the programs for others' processes that reused their pids."""
    started(appliance)
    orphans = kill_supervisord(appliance)
    assert gateway_answers(appliance), "the gateway serves on without supervisord"

    again = stepped(appliance, 44, "up")
    assert again.returncode == 0, again.stdout + again.stderr
    assert not live(orphans), "up ended every program the dead supervisord left"
    assert gateway_answers(appliance)

    orphans = kill_supervisord(appliance)
    stopped = stepped(appliance, -3600, "down")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "ended leftover processes" in stopped.stdout
    assert not live(orphans), "down ended every program the dead supervisord left"
    assert not gateway_answers(appliance)
    assert status(appliance)["supervisord"]["running"] is False
