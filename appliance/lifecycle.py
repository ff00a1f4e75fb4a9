"""up, down and status: the appliance's processes as one unit under supervisord."""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from appliance.durable import replace_file
from appliance.errors import ApplianceError, StartError
from appliance.home import Home
from appliance.orphans import end_leftovers, end_starting, mark_starting, restore_priority
from appliance.programs import Program, discover_programs, run_provisioners
from appliance.secrets import secret
from appliance.supervisor import (
    FAILED_STATES,
    ProcessState,
    Supervisor,
    log_file,
    render_config,
    socket_path,
)
from appliance.up_steps import STEPS, UpSteps, forget_steps, read_steps, record_steps, up_lock, up_running

if TYPE_CHECKING:  # `status` builds neither the settings' nor the hosts' schemas
    from appliance.settings import Settings

Progress = Callable[[str], None]


def _no_progress(_: str) -> None:
    pass


def _programs_file(home: Home) -> Path:
    """The programs `up` started, so status describes what runs rather than current settings."""
    return home.run / "programs.json"


def _settings_file(home: Home) -> Path:
    return home.run / "settings-started.json"


@dataclass
class UpReport:
    already_up: bool
    programs: list[Program]
    startup_s: dict[str, float] = field(default_factory=dict)
    notices: list[str] = field(default_factory=list)
    finished: tuple[str, ...] = ()  # the steps an `up` before left undone, done by this one


def up(settings: Settings, home: Home, progress: Progress = _no_progress) -> UpReport:
    """Start supervisord with every program, wait until each answers its health check, then
    provision; or finish the steps an `up` killed half-way left undone (up_steps).

    A failed start stops whatever it started, so the appliance is either up or down.
    """
    home.ensure()
    with up_lock(home):
        supervisor = Supervisor(home)
        if supervisor.is_running():
            steps = read_steps(home)
            if steps is not None and not steps.left:
                return UpReport(already_up=True, programs=started_programs(home))
            # No record: an older version's `up`, whose steps are unknown; all are done again.
            return _finish(settings, home, supervisor, steps or UpSteps(STEPS[:1]), progress)
        return _start(settings, home, supervisor, progress)


def _start(settings: Settings, home: Home, supervisor: Supervisor, progress: Progress) -> UpReport:
    # Leftovers of an earlier run that died hard would hold ports, memory and cores.
    end_leftovers(home.run)
    programs = discover_programs(settings, home)
    check_startable(programs, home)
    record_started(home, settings, programs)
    progress("starting supervisord")
    record_steps(home, UpSteps())
    mark_starting(home.run)  # programs with a start_nice start at it until end_starting
    with _stopped_on_failure(supervisor, home, progress, "start failed: stopping what was started"):
        try:
            supervisor.start(supervisor_config(home, programs))
            steps = record_steps(home, UpSteps().after("supervisord"))
            startup = wait_ready(supervisor, programs, home, progress)
        finally:
            end_starting(home.run)
        steps = record_steps(home, steps.after("ready"))
        notices = _remaining_steps(settings, home, programs, steps, progress)
    return UpReport(already_up=False, programs=programs, startup_s=startup, notices=notices)


def _finish(settings: Settings, home: Home, supervisor: Supervisor, steps: UpSteps,
            progress: Progress) -> UpReport:
    """The steps an `up` killed half-way left undone, on the programs it started; a failure
    stops everything, as a failed start does."""
    programs = started_programs(home)
    left = steps.left
    progress(f"finishing an interrupted `up`: {', '.join(left)}")
    with _stopped_on_failure(supervisor, home, progress, "finishing failed: stopping the appliance"):
        end_starting(home.run)  # the killed `up`'s mark: restarts from now on are at normal priority
        startup: dict[str, float] = {}
        if "ready" in left:
            startup = wait_ready(supervisor, programs, home, progress)
            steps = record_steps(home, steps.after("ready"))
        notices = _remaining_steps(settings, home, programs, steps, progress)
    return UpReport(already_up=False, programs=programs, startup_s=startup, notices=notices, finished=left)


@contextlib.contextmanager
def _stopped_on_failure(supervisor: Supervisor, home: Home, progress: Progress, saying: str) -> Iterator[None]:
    """Stop everything if the block fails (even interrupted), so the appliance is either up or down."""
    try:
        yield
    except BaseException:
        progress(saying)
        _stop(supervisor, home)
        raise


def _remaining_steps(settings: Settings, home: Home, programs: list[Program], steps: UpSteps,
                     progress: Progress) -> list[str]:
    """Once every program is ready: normal CPU priority again, then the provisioners; each
    recorded when done. Both may be done again safely."""
    notices: list[str] = []
    if "priority" in steps.left:
        notices = [why for p in programs if p.start_nice and (why := restore_priority(home.run, p.name))]
        steps = record_steps(home, steps.after("priority"))
    progress("provisioning")
    notices += run_provisioners(settings, home)
    record_steps(home, steps.after("provisioned"))
    return notices


def supervisor_config(home: Home, programs: list[Program]) -> str:
    """supervisord's configuration for `programs`, each run through appliance.orphans."""
    return render_config(home, [_wrap(program, home) for program in programs], secret(home, "supervisor-password"))


def _wrap(program: Program, home: Home) -> Program:
    """Run the program through appliance.orphans, which ends a dead predecessor's workers (and
    starts it at its start_nice while `up` runs)."""
    socket = ["--socket", str(program.socket)] if program.socket else []
    nice = ["--nice", str(program.start_nice)] if program.start_nice else []
    command = [sys.executable, "-P", "-m", "appliance.orphans", program.name, str(home.run), *socket, *nice,
               "--", *program.command]
    return program.model_copy(update={"command": command})


def check_startable(programs: list[Program], home: Home) -> None:
    """StartError for the first program that cannot start: something it needs is missing, or its
    port is taken."""
    for program in programs:
        if program.missing:
            raise StartError(f"{program.name}: {program.missing}", log=appliance_log(home))
        if program.port is not None and not _port_free(program.port):
            raise StartError(
                f"{program.name}: port {program.port} is already in use{_port_owner(program.port)}",
                log=appliance_log(home),
                hint="stop that process or choose another port in settings",
            )


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # As the servers bind: connections of a stopped server lingering in TIME_WAIT do not count.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _port_owner(port: int) -> str:
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                return f" (by pid {conn.pid}, {psutil.Process(conn.pid).name()})"
    except (psutil.Error, OSError):
        pass
    return ""


def appliance_log(home: Home) -> Path:
    """Where the CLI records the errors it reports."""
    return home.logs / "appliance.log"


def wait_ready(
    supervisor: Supervisor, programs: list[Program], home: Home, progress: Progress
) -> dict[str, float]:
    """Wait for every program's health URL; fail fast if its process exits meanwhile."""
    started = time.monotonic()
    waiting = {p.name: p for p in programs if p.health_url and p.autostart}
    first_pid: dict[str, int] = {}
    ready: dict[str, float] = {}
    from appliance import health  # httpx and the appliance's CA: only to ask programs that run

    with health.client(home) as client:
        while waiting:
            infos = {info.name: info for info in supervisor.processes()}
            for name, program in list(waiting.items()):
                info = infos[name]
                if info.pid:
                    first_pid.setdefault(name, info.pid)
                restarted = info.pid and info.pid != first_pid[name]
                if info.state in FAILED_STATES or restarted:
                    raise StartError(
                        f"{name} exited during start: {failure_reason(log_file(home, name))}",
                        log=log_file(home, name),
                    )
                elapsed = time.monotonic() - started
                if info.state == ProcessState.RUNNING and health.answers(client, program, home):
                    ready[name] = round(elapsed, 1)
                    del waiting[name]
                    progress(f"{name} ready after {elapsed:.0f}s")
                elif elapsed > program.start_timeout_s:
                    raise StartError(
                        f"{name} did not answer {program.health_url} within {program.start_timeout_s}s",
                        log=log_file(home, name),
                    )
                else:
                    progress(f"waiting for {name} ({info.state.name.lower()}, {elapsed:.0f}s)")
            time.sleep(0.5)
    return ready


def failure_reason(log: Path, tail_bytes: int = 64_000) -> str:
    """The most telling line at the end of a program's log: the last error, else the last line."""
    try:
        with log.open("rb") as handle:
            handle.seek(max(0, log.stat().st_size - tail_bytes))
            lines = [line.strip() for line in handle.read().decode(errors="replace").splitlines()]
    except OSError:
        return "no log written"
    lines = [line for line in lines if line]
    for line in reversed(lines):
        if "Error" in line or "error" in line.split(":", 1)[0].lower():
            return line[:300]
    return lines[-1][:300] if lines else "log is empty"


@dataclass
class DownReport:
    was_running: bool
    ended_leftovers: list[int]


def down(home: Home) -> DownReport:
    """Stop every program and supervisord; end any process they left behind."""
    supervisor = Supervisor(home)
    if not supervisor.is_running():
        forget_steps(home)
        return DownReport(was_running=False, ended_leftovers=end_leftovers(home.run))
    return DownReport(was_running=True, ended_leftovers=_stop(supervisor, home))


def _stop(supervisor: Supervisor, home: Home) -> list[int]:
    forget_steps(home)  # whatever happens next, no `up` is left to finish: a next `up` starts afresh
    supervisor.shutdown()
    return end_leftovers(home.run)


def record_started(home: Home, settings: Settings, programs: list[Program]) -> None:
    """Record the programs started and the settings they started with (`appliance settings apply`
    compares the settings file with the latter). 0600: the programs' commands and environments
    are the appliance's business only."""
    replace_file(_programs_file(home), json.dumps([p.model_dump(mode="json") for p in programs]).encode())
    replace_file(_settings_file(home), json.dumps(settings.comparable()).encode())


def started_settings(home: Home) -> dict[str, Any] | None:
    """The settings the running programs started with (secrets as digests); None if no record
    (an `up` of an older version recorded none)."""
    try:
        data = json.loads(_settings_file(home).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def started_programs(home: Home) -> list[Program]:
    """The programs the last `up` started (with the GPUs each pool holds); none if it never ran."""
    try:
        return [Program.model_validate(p) for p in json.loads(_programs_file(home).read_text())]
    except (OSError, ValueError):
        return []


def status(home: Home) -> dict[str, Any]:
    """supervisord's view of every program, plus each program's own health answer."""
    supervisor = Supervisor(home)
    running = supervisor.is_running()
    programs = []
    if running:
        from appliance import health  # httpx and the appliance's CA: `status` with nothing running needs neither

        infos = {info.name: info for info in supervisor.processes()}
        with health.client(home) as client:
            for program in started_programs(home):
                info = infos.get(program.name)
                programs.append({
                    "name": program.name,
                    "pool": program.pool,
                    "gpus": program.gpus,
                    "state": info.state.name if info else "UNKNOWN",
                    "pid": info.pid if info else 0,
                    "uptime_s": info.uptime_s if info else 0,
                    "model": program.model,
                    "port": program.port,
                    "socket": str(program.socket) if program.socket else None,
                    "healthy": bool(info and info.state == ProcessState.RUNNING
                                    and health.answers(client, program, home)),
                    "urls": program.urls,
                    "log": str(log_file(home, program.name)),
                })
    return {
        "home": str(home.root),
        "supervisord": {
            "running": running,
            "pid": supervisor.daemon_pid() if running else None,
            "socket": str(socket_path(home)),
        },
        "programs": programs,
        "up": _up_steps(home),
        "cluster": _cluster(home) if running else [],
        "alerts": _alerts(home, programs),
    }


def _up_steps(home: Home) -> dict[str, Any]:
    """The steps of the last `up` left undone (none once it finished, or if it recorded none), and
    whether an `up` runs now: an `up` killed half-way leaves steps that the next `up` finishes."""
    steps = read_steps(home)
    return {"steps_left": list(steps.left) if steps else [], "running": up_running(home)}


def _alerts(home: Home, programs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The firing alerts, from the appliance's Alertmanager if it runs (None if it does not)."""
    alertmanager = next((p for p in programs if p["name"] == "alertmanager"), None)
    if alertmanager is None or alertmanager["state"] != ProcessState.RUNNING.name:
        return None
    from appliance import alerts  # httpx: only when there is an Alertmanager to ask

    try:
        return {"firing": [a.model_dump(mode="json") for a in alerts.firing_at(alertmanager["urls"]["alertmanager"],
                                                                                 home)], "error": None}
    except ApplianceError as exc:
        return {"firing": [], "error": exc.one_line()}


def _cluster(home: Home) -> list[dict[str, Any]]:
    """Each pool spanning hosts: its epoch, whether it serves, and every host's rank (on the head)."""
    from appliance import hosts

    registry = hosts.load(home)
    pools = []
    for path in sorted((home.run / "cluster").glob("*.json")):
        state = hosts.read_cluster_state(path)
        if state is not None:
            view = state.model_dump(mode="json")
            for rank in view["ranks"]:
                record = registry.hosts.get(rank["host"])
                rank["host_state"] = record.state.value if record else ("head" if rank["node"] == 0 else "not added")
            pools.append(view)
    return pools

