"""Find and end processes a supervised program left behind.

supervisord puts SUPERVISOR_SERVER_URL and SUPERVISOR_PROCESS_NAME into every child's
environment, and children of children inherit them. When a program's main process dies hard
(kill -9, OOM), its workers (vLLM's EngineCore and Worker processes) are re-parented and keep
their memory and cores; supervisord's stopasgroup never reaches them. Every supervised program is
therefore started through `python -m appliance.orphans NAME SOCKET -- COMMAND...`, which ends the
previous instance's leftovers and then execs COMMAND, so the pid supervisord sees is COMMAND's own.
`appliance down` calls `end_leftovers` once more for whatever remains.
"""

from __future__ import annotations

import os
import sys
import time

import psutil


def leftovers(server_url: str, program: str | None = None) -> list[psutil.Process]:
    """Live processes started by the supervisord at `server_url` (for `program`, or any)."""
    found = []
    me = os.getpid()
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            env = proc.environ()
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if env.get("SUPERVISOR_SERVER_URL") != server_url:
            continue
        if program is None or env.get("SUPERVISOR_PROCESS_NAME") == program:
            found.append(proc)
    return found


def end_leftovers(server_url: str, program: str | None = None, grace_s: float = 5.0) -> list[int]:
    """SIGTERM, then SIGKILL after `grace_s`, every leftover process; return their pids."""
    procs = leftovers(server_url, program)
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


def main(argv: list[str]) -> None:
    """`NAME SERVER_URL -- COMMAND...`: end NAME's leftovers, then exec COMMAND."""
    if len(argv) < 4 or argv[2] != "--":
        sys.exit("usage: python -m appliance.orphans NAME SERVER_URL -- COMMAND...")
    name, server_url, command = argv[0], argv[1], argv[3:]
    ended = end_leftovers(server_url, name)
    if ended:
        print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} ended leftovers of a previous {name}: {ended}",
              flush=True)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
