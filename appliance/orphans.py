"""End the processes a supervised program left behind when it died hard.

supervisord makes each program the leader of its own process group, and workers inherit it.
When a program's main process dies hard (kill -9, OOM), its workers (vLLM's EngineCore and
Worker processes) are re-parented and keep their memory and cores; supervisord's stopasgroup
never reaches them, because it signals the new instance's group. vLLM renames its workers
(setproctitle), which overwrites their /proc environ, so the group id is the reliable mark.

Every supervised program is started through `python -m appliance.orphans NAME RUN_DIR --
COMMAND...`: it ends the previous instance's group, records its own group id in
RUN_DIR/NAME.pgid, then execs COMMAND, so the pid supervisord sees is COMMAND's own.
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


def end_group(pgid: int, grace_s: float = 5.0) -> list[int]:
    """SIGTERM every member of process group `pgid`, SIGKILL survivors after `grace_s`."""
    procs = group_members(pgid)
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


def end_leftovers(run_dir: Path, program: str | None = None) -> list[int]:
    """End the recorded process group of `program` (or of every program); return ended pids."""
    files = [pgid_file(run_dir, program)] if program else sorted(run_dir.glob("*.pgid"))
    ended: list[int] = []
    for path in files:
        try:
            pgid = int(path.read_text().strip())
        except (OSError, ValueError):
            continue
        if pgid != os.getpgrp():
            ended += end_group(pgid)
        path.unlink(missing_ok=True)
    return ended


def main(argv: list[str]) -> None:
    """`NAME RUN_DIR -- COMMAND...`: end NAME's leftovers, record this group, exec COMMAND."""
    if len(argv) < 4 or argv[2] != "--":
        sys.exit("usage: python -m appliance.orphans NAME RUN_DIR -- COMMAND...")
    name, run_dir, command = argv[0], Path(argv[1]), argv[3:]
    ended = end_leftovers(run_dir, name)
    if ended:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        print(f"{stamp} ended leftovers of a previous {name}: pids {ended}", flush=True)
    pgid_file(run_dir, name).write_text(f"{os.getpgrp()}\n")
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
