"""End the processes a supervised program left behind when it died hard.

supervisord makes each program the leader of its own process group, and workers inherit it.
When a program's main process dies hard (kill -9, OOM), its workers (vLLM's EngineCore and
Worker processes) are re-parented and keep their memory and cores; supervisord's stopasgroup
never reaches them, because it signals the new instance's group. vLLM renames its workers
(setproctitle), which overwrites their /proc environ, so the group id is the reliable mark.

Every supervised program is started through `python -m appliance.orphans NAME RUN_DIR --
COMMAND...`: it ends the previous instance's group, records its own group id in
RUN_DIR/NAME.pgid (0600) with the boot's id and the group leader's start, then execs COMMAND,
so the pid supervisord sees is COMMAND's own. A record is acted on only in the boot that wrote
it and only for processes that started no earlier than its leader, so a group id reused by
another program after a reboot, or later, is never signalled.
`appliance up` and `down` end whatever groups remain recorded.

A start is the kernel's count of clock ticks since boot (/proc/PID/stat), never a wall-clock
time: psutil's create_time adds a boot time the kernel derives from the wall clock, so a step of
the clock (NTP, an operator) made every recorded group look like another's, and `up` and `down`
then left a whole appliance running that they no longer knew.

The same records let `up` start some programs at a lower CPU priority (`--nice N`: Keycloak,
which the engines do not need, yields the cores to them while they load) and return them to
normal once everything is ready. The wrapper lowers the priority only while the `up` that wrote
RUN_DIR/up.starting still runs: a later restart by supervisord starts at normal priority.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil


def pgid_file(run_dir: Path, program: str) -> Path:
    return run_dir / f"{program}.pgid"


def group_members(pgid: int) -> list[psutil.Process]:
    """This user's processes in group `pgid`, this one left out."""
    me = os.getpid()
    members = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != me and os.getpgid(proc.pid) == pgid and proc.uids().real == os.getuid():
                members.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def end_processes(procs: list[psutil.Process], grace_s: float = 5.0) -> list[int]:
    """SIGTERM each of `procs`, SIGKILL survivors after `grace_s`."""
    for proc in procs:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    return [proc.pid for proc in procs]


def boot_id() -> str:
    """This boot's id: process start times and group ids mean nothing across a reboot."""
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def start_ticks(pid: int) -> int:
    """When process `pid` started, in clock ticks since boot (/proc/PID/stat, field 22): what a
    step of the wall clock cannot change. OSError (FileNotFoundError, ProcessLookupError) if it
    is gone."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    # After the last ')': the command name before it may hold spaces and parentheses.
    return int(stat.rsplit(")", 1)[1].split()[19])


def _ticks_or_none(pid: int) -> int | None:
    try:
        return start_ticks(pid)
    except (OSError, ValueError, IndexError):
        return None


TICKS_TAG = "ticks:"


@dataclass(frozen=True)
class Recorded:
    """A process as a record names it: its pid, the boot and its start, in ticks since boot; or,
    in a record an older version wrote, as a wall-clock time (`wall`, `ticks` None)."""

    pid: int
    boot: str
    ticks: int | None = None
    wall: float | None = None

    def line(self) -> str:
        return f"{self.pid} {self.boot} {TICKS_TAG}{self.ticks}\n"


def identify(pid: int) -> Recorded:
    """Process `pid` as a record names it (OSError if it is gone)."""
    return Recorded(pid, boot_id(), start_ticks(pid))


def parse_record(text: str) -> Recorded | None:
    """A record's process, None if it is malformed. `PID BOOT ticks:N`; `PID BOOT SECONDS` is an
    older version's, read so that an upgrade can still end what that version started."""
    try:
        pid_text, boot, start = text.split()
        pid = int(pid_text)
        if start.startswith(TICKS_TAG):
            ticks = int(start.removeprefix(TICKS_TAG))
            return Recorded(pid, boot, ticks=ticks) if pid > 0 and ticks >= 0 else None
        return Recorded(pid, boot, wall=float(start)) if pid > 0 else None
    except ValueError:
        return None


def group_started(recorded: Recorded, boot: str, leader_ticks: int | None,
                  leader_wall: Callable[[], float]) -> int | None:
    """From which start (ticks since boot) the processes now in the recorded group are the ones it
    recorded; None if the group is not the recorded one. `boot`: this boot's id; `leader_ticks`:
    the start of whatever process holds the recorded pid now (None: none does); `leader_wall`: that
    process's wall-clock start, asked only of an older version's record."""
    if recorded.boot != boot:
        return None
    if recorded.ticks is not None:
        if leader_ticks is not None and leader_ticks != recorded.ticks:
            return None  # the pid is another process's now: the recorded group ended
        return recorded.ticks  # the same leader, or it died hard and its workers are what is left
    # An older version's record (a wall-clock start), trusted only as far as that version did and
    # no further: its leader must still run and start when that clock said (a clock step since
    # makes it unknown, and so left alone); with the leader gone, nothing tells its workers from
    # another group's, so none is signalled.
    if leader_ticks is None or recorded.wall is None or abs(leader_wall() - recorded.wall) > 0.01:
        return None
    return leader_ticks


def group_record() -> str:
    """What a pgid file says of this process's group: its id, the boot and its leader's start."""
    return identify(os.getpgrp()).line()


def recorded_members(record: str) -> list[psutil.Process]:
    """The processes still in a recorded group: none if the record is from another boot or
    malformed, or if the group id now belongs to another group (its leader started at another
    time); otherwise the members that started no earlier than the recorded leader."""
    recorded = parse_record(record)
    if recorded is None or recorded.pid == os.getpgrp():
        return []
    started = group_started(recorded, boot_id(), _ticks_or_none(recorded.pid),
                            lambda: psutil.Process(recorded.pid).create_time())
    if started is None:
        return []
    members = []
    for proc in group_members(recorded.pid):
        member_started = _ticks_or_none(proc.pid)
        if member_started is not None and member_started >= started:
            members.append(proc)
    return members


def starting_file(run_dir: Path) -> Path:
    return run_dir / "up.starting"


def mark_starting(run_dir: Path) -> None:
    """Say that this process (`appliance up`) is starting the programs, until `end_starting`."""
    path = starting_file(run_dir)
    path.write_text(identify(os.getpid()).line())
    path.chmod(0o600)


def end_starting(run_dir: Path) -> None:
    starting_file(run_dir).unlink(missing_ok=True)


def still_running(record: str) -> bool:
    """Whether the process a record names (`identify`) still runs: in this boot, the same start."""
    recorded = parse_record(record)
    if recorded is None or recorded.ticks is None:
        return False  # an older version's mark: its `up` has been replaced, so it is not running
    return recorded.boot == boot_id() and _ticks_or_none(recorded.pid) == recorded.ticks


def up_is_starting(run_dir: Path) -> bool:
    """Whether the `up` that marked the run directory is still running (in this boot)."""
    try:
        return still_running(starting_file(run_dir).read_text())
    except OSError:
        return False


def restore_priority(run_dir: Path, program: str) -> str | None:
    """Return a program started with `--nice` to niceness 0, every process and thread of its
    group; why not, if the kernel refused (lowering niceness needs root or CAP_SYS_NICE)."""
    try:
        record = pgid_file(run_dir, program).read_text()
    except OSError:
        return None  # not running: a restart starts at normal priority anyway
    members = recorded_members(record)
    try:
        if members:
            os.setpriority(os.PRIO_PGRP, int(record.split()[0]), 0)
        # Processes that left the group (PostgreSQL's backends lead sessions of their own) keep the
        # priority they were forked with: each of them too, every thread.
        for member in members:
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                for child in member.children(recursive=True):
                    with contextlib.suppress(psutil.Error, ProcessLookupError):
                        for thread in child.threads():
                            os.setpriority(os.PRIO_PROCESS, thread.id, 0)
    except PermissionError:
        return (f"{program} keeps the low CPU priority it started at: raising it again needs root or "
                "CAP_SYS_NICE (set engine.yield_nice to 0 to start it at normal priority)")
    except ProcessLookupError:
        pass  # it ended meanwhile
    return None


def end_leftovers(run_dir: Path, program: str | None = None) -> list[int]:
    """End the recorded process group of `program` (or of every program); return ended pids."""
    files = [pgid_file(run_dir, program)] if program else sorted(run_dir.glob("*.pgid"))
    ended: list[int] = []
    for path in files:
        try:
            record = path.read_text()
        except OSError:
            continue
        ended += end_processes(recorded_members(record))
        path.unlink(missing_ok=True)
    return ended


USAGE = "usage: python -m appliance.orphans NAME RUN_DIR [--socket PATH] [--nice N] -- COMMAND..."


def main(argv: list[str]) -> None:
    """`NAME RUN_DIR [--socket PATH] [--nice N] -- COMMAND...`: end NAME's leftovers, make the
    socket's directory private (0700) and remove a stale socket there (a dead engine leaves its
    socket behind, and binding it again fails), lower the CPU priority by N while `up` is starting
    the appliance, record this group, exec COMMAND."""
    options: dict[str, str] = {}
    while len(argv) > 3 and argv[2] in ("--socket", "--nice") and argv[2] not in options:
        options[argv[2]], argv = argv[3], argv[:2] + argv[4:]
    if len(argv) < 4 or argv[2] != "--" or not options.get("--nice", "0").isdigit():
        sys.exit(USAGE)
    name, run_dir, command = argv[0], Path(argv[1]), argv[3:]
    socket = Path(options["--socket"]) if "--socket" in options else None
    ended = end_leftovers(run_dir, name)
    if int(options.get("--nice", "0")) and up_is_starting(run_dir):
        os.nice(int(options["--nice"]))
    if socket is not None:
        socket.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        socket.parent.chmod(0o700)
        socket.unlink(missing_ok=True)  # its previous owner is ended (above)
    if ended:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        print(f"{stamp} ended leftovers of a previous {name}: pids {ended}", flush=True)
    path = pgid_file(run_dir, name)
    path.write_text(group_record())
    path.chmod(0o600)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
