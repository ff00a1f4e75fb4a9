"""End the processes a supervised program left behind when it died hard.

supervisord makes each program the leader of its own process group, and workers inherit it.
When a program's main process dies hard (kill -9, OOM), its workers (vLLM's EngineCore and
Worker processes) are re-parented and keep their memory and cores; supervisord's stopasgroup
never reaches them, because it signals the new instance's group. vLLM renames its workers
(setproctitle), which overwrites their /proc environ, so the group id is the reliable mark.

Every supervised program is started through `python -m appliance.orphans NAME RUN_DIR --
COMMAND...`: it ends the previous instance's group, records its own group id in
RUN_DIR/NAME.pgid (0600) with the boot's id and the group leader's start time, then execs
COMMAND, so the pid supervisord sees is COMMAND's own. A record is acted on only in the boot
that wrote it and only for processes that started no earlier than its leader, so a group id
reused by another program after a reboot, or later, is never signalled.
`appliance up` and `down` end whatever groups remain recorded.
"""

from __future__ import annotations

import os
import sys
import time
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


def group_record() -> str:
    """What a pgid file says of this process's group: its id, the boot and its leader's start."""
    return f"{os.getpgrp()} {boot_id()} {psutil.Process(os.getpgrp()).create_time():.3f}\n"


def recorded_members(record: str) -> list[psutil.Process]:
    """The processes still in a recorded group: none if the record is from another boot or
    malformed, or if the group id now belongs to another group (its leader started at another
    time); otherwise the members that started no earlier than the recorded leader."""
    try:
        pgid_text, boot, started_text = record.split()
        pgid, started = int(pgid_text), float(started_text)
    except ValueError:
        return []
    if boot != boot_id() or pgid == os.getpgrp():
        return []
    try:
        if abs(psutil.Process(pgid).create_time() - started) > 0.01:
            return []  # the id was reused by another group
    except psutil.NoSuchProcess:
        pass  # the leader died hard: its workers are what is left
    except psutil.Error:
        return []
    members = []
    for proc in group_members(pgid):
        try:
            if proc.create_time() >= started - 0.01:
                members.append(proc)
        except psutil.Error:
            continue
    return members


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


def main(argv: list[str]) -> None:
    """`NAME RUN_DIR [--socket PATH] -- COMMAND...`: end NAME's leftovers, make the socket's
    directory private (0700) and remove a stale socket there (a dead engine leaves its socket
    behind, and binding it again fails), record this group, exec COMMAND."""
    socket = None
    if len(argv) > 3 and argv[2] == "--socket":
        socket, argv = Path(argv[3]), argv[:2] + argv[4:]
    if len(argv) < 4 or argv[2] != "--":
        sys.exit("usage: python -m appliance.orphans NAME RUN_DIR [--socket PATH] -- COMMAND...")
    name, run_dir, command = argv[0], Path(argv[1]), argv[3:]
    ended = end_leftovers(run_dir, name)
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
