"""supervisord: its config file, the daemon, and a client over its XML-RPC unix socket."""

from __future__ import annotations

import collections
import os
import re
import resource
import shlex
import subprocess
import sys
import threading
import time
import xmlrpc.client
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any

import psutil
from supervisor.xmlrpc import SupervisorTransport

from appliance.errors import SupervisorError
from appliance.home import BACKUP_PASSPHRASE_ENV, PRIVATE_UMASK, Home
from appliance.programs import OFFLINE_ENVIRONMENT, Program
from appliance.secrets import secret

RPC_USER = "appliance"
# Unix socket paths are limited to 107 bytes on Linux.
_MAX_SOCKET_PATH = 107


class ProcessState(IntEnum):
    """supervisord's process states (supervisor/states.py)."""

    STOPPED = 0
    STARTING = 10
    RUNNING = 20
    BACKOFF = 30
    STOPPING = 40
    EXITED = 100
    FATAL = 200
    UNKNOWN = 1000


SPAWNED = re.compile(r"spawned: '([^']+)' with pid")
FAILED_STATES = {ProcessState.BACKOFF, ProcessState.EXITED, ProcessState.FATAL}
LIVE_STATES = {ProcessState.STARTING, ProcessState.RUNNING}  # its process exists


@dataclass(frozen=True)
class ProcessInfo:
    """One program as supervisord reports it."""

    name: str
    state: ProcessState
    pid: int
    uptime_s: int
    log: Path
    description: str

    @classmethod
    def from_rpc(cls, info: dict[str, Any]) -> ProcessInfo:
        running = info["state"] == ProcessState.RUNNING
        return cls(
            name=info["name"],
            state=ProcessState(info["state"]),
            pid=info["pid"],
            uptime_s=(info["now"] - info["start"]) if running else 0,
            log=Path(info["stdout_logfile"]),
            description=info["description"],
        )


def _escape(value: str) -> str:
    """supervisord expands %(name)s in its config; a literal % must be doubled."""
    return value.replace("%", "%%")


def _env_pair(key: str, value: str) -> str:
    """KEY="value" as supervisord's (non-POSIX shlex) parser reads it back unchanged.

    That parser has no escapes: a value is quoted with whichever quote it does not contain, and
    values it cannot carry are refused rather than silently altered.
    """
    quote = "'" if '"' in value else '"'
    if quote in value or value[:1] in ("'", '"') or value[-1:] in ("'", '"'):
        raise SupervisorError(f"environment variable {key} has a value supervisord cannot carry "
                              "(a quote at either end, or quotes of both kinds)")
    return f"{key}={quote}{_escape(value)}{quote}"


def render_config(home: Home, programs: list[Program], password: str) -> str:
    """The supervisord.conf text for these programs: private socket, logs under the state dir."""
    sock = socket_path(home)
    lines = [
        "[unix_http_server]",
        f"file={sock}",
        "chmod=0700",
        f"username={RPC_USER}",
        f"password={password}",
        "",
        "[supervisord]",
        f"logfile={home.logs / 'supervisord.log'}",
        f"pidfile={pid_file(home)}",
        f"childlogdir={home.logs}",
        f"directory={home.root}",
        f"umask={PRIVATE_UMASK:03o}",  # supervisord's own (its logs) and so every program's
        "identifier=appliance",
        # Raised for supervisord and so for every program: the gateway holds one per connection.
        f"minfds={min_fds()}",
        "nodaemon=false",
        "environment=" + ",".join(_env_pair(key, value) for key, value in sorted(OFFLINE_ENVIRONMENT.items())),
        "",
        "[rpcinterface:supervisor]",
        "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface",
        "",
        "[supervisorctl]",
        f"serverurl=unix://{sock}",
        f"username={RPC_USER}",
        f"password={password}",
    ]
    for program in programs:
        env = ",".join(_env_pair(key, value) for key, value in sorted(program.environment.items()))
        lines += [
            "",
            f"[program:{program.name}]",
            f"command={_escape(shlex.join(program.command))}",
            *([f"environment={env}"] if env else []),
            *([f"directory={program.directory}"] if program.directory else []),
            f"priority={program.priority}",
            f"autostart={str(program.autostart).lower()}",
            f"autorestart={str(program.autostart).lower()}",
            f"startsecs={program.startsecs}",
            "startretries=3",
            # Engines fork workers: signal the whole process group so none outlive the server.
            "stopasgroup=true",
            "killasgroup=true",
            f"stopwaitsecs={program.stopwaitsecs}",
            f"stopsignal={program.stop_signal}",
            "redirect_stderr=true",
            f"stdout_logfile={log_file(home, program.name)}",
            "stdout_logfile_maxbytes=50MB",
            "stdout_logfile_backups=3",
        ]
    return "\n".join(lines) + "\n"


def min_fds(wanted: int = 65536) -> int:
    """supervisord's open-file limit: `wanted`, or the hard limit if lower (only root may go
    beyond it, and supervisord refuses to start when it cannot reach minfds)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)


def socket_path(home: Home) -> Path:
    return home.run / "supervisor.sock"


def pid_file(home: Home) -> Path:
    return home.run / "supervisord.pid"


def config_file(home: Home) -> Path:
    return home.run / "supervisord.conf"


def log_file(home: Home, program: str) -> Path:
    return home.logs / f"{program}.log"


class Supervisor:
    """A client for the appliance's supervisord, which it can also start."""

    def __init__(self, home: Home) -> None:
        self.home = home
        sock = socket_path(home)
        if len(str(sock)) > _MAX_SOCKET_PATH:
            raise SupervisorError(
                f"supervisor socket path {sock} is longer than {_MAX_SOCKET_PATH} bytes",
                hint="use a shorter APPLIANCE_HOME",
            )
        self._sock = sock

    def _proxy(self) -> Any:
        password = secret(self.home, "supervisor-password")
        transport = SupervisorTransport(RPC_USER, password, f"unix://{self._sock}")
        return xmlrpc.client.ServerProxy("http://127.0.0.1", transport=transport)

    def call(self, method: str, *args: Any) -> Any:
        """Call supervisor.<method>; unreachable or failing calls raise SupervisorError."""
        try:
            return getattr(self._proxy().supervisor, method)(*args)
        except xmlrpc.client.Fault as exc:
            raise SupervisorError(f"supervisord refused {method}: {exc.faultString}") from exc
        except OSError as exc:
            raise SupervisorError(
                f"supervisord is not reachable at {self._sock}: {exc}",
                log=self.home.logs / "supervisord.log",
            ) from exc

    def is_running(self) -> bool:
        """True if supervisord answers on its socket."""
        if not self._sock.exists():
            return False
        try:
            state: str = self.call("getState")["statename"]
        except SupervisorError:
            return False
        return state == "RUNNING"

    def daemon_pid(self) -> int | None:
        """supervisord's own pid, from its pid file."""
        try:
            return int(pid_file(self.home).read_text().strip())
        except (OSError, ValueError):
            return None

    def start(self, config_text: str, timeout_s: float = 30.0) -> None:
        """Write the config (0600: it holds the RPC password) and start the daemon."""
        conf = self._write_config(config_text)
        supervisord = Path(sys.executable).with_name("supervisord")
        environment = {key: value for key, value in os.environ.items() if key != BACKUP_PASSPHRASE_ENV}
        result = subprocess.run(
            [str(supervisord), "-c", str(conf)], capture_output=True, text=True, check=False, env=environment
        )
        if result.returncode != 0:
            reason = (result.stderr or result.stdout).strip().splitlines()
            raise SupervisorError(
                f"supervisord did not start: {reason[-1] if reason else result.returncode}",
                log=self.home.logs / "supervisord.log",
            )
        deadline = time.monotonic() + timeout_s
        while not self.is_running():
            if time.monotonic() > deadline:
                raise SupervisorError(
                    f"supervisord did not answer within {timeout_s:.0f}s",
                    log=self.home.logs / "supervisord.log",
                )
            time.sleep(0.1)

    def _write_config(self, config_text: str) -> Path:
        conf = config_file(self.home)
        tmp = conf.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(config_text)
        os.replace(tmp, conf)
        return conf

    def restart(self, name: str) -> None:
        """Stop program `name` if it runs (waiting until it has exited) and start it again as its
        configuration says; does not wait for it to be up."""
        if ProcessState(self.call("getProcessInfo", name)["state"]) in {*LIVE_STATES, ProcessState.BACKOFF}:
            self.call("stopProcess", name, True)
        self.call("startProcess", name, False)

    def reconfigure(self, config_text: str) -> None:
        """Write a new config and have supervisord read it; programs run on as they are until
        `replace` swaps each in."""
        self._write_config(config_text)
        self.call("reloadConfig")

    def replace(self, name: str) -> None:
        """Stop program `name` (waiting until it has exited) and start it from the config last
        read (`reconfigure`); does not wait for it to be up."""
        self.call("stopProcessGroup", name, True)
        self.call("removeProcessGroup", name)
        self.call("addProcessGroup", name)

    def processes(self) -> list[ProcessInfo]:
        """Every program supervisord knows, with its state."""
        return [ProcessInfo.from_rpc(info) for info in self.call("getAllProcessInfo")]

    def restarts(self) -> dict[str, int]:
        """How often each program was started again after its first start, from supervisord's log
        (its own restarts after a crash included; the log lives as long as the state dir)."""
        spawned = _spawn_counts(self.home.logs / "supervisord.log")
        return {name: count - 1 for name, count in spawned.items()}

    def shutdown(self, timeout_s: float = 120.0) -> None:
        """Stop every program (process groups included), then supervisord itself, and wait."""
        pid = self.daemon_pid()
        self.call("stopAllProcesses", True)
        self.call("shutdown")
        deadline = time.monotonic() + timeout_s
        while pid is not None and pid_alive(pid):
            if time.monotonic() > deadline:
                raise SupervisorError(f"supervisord (pid {pid}) did not exit within {timeout_s:.0f}s")
            time.sleep(0.1)


@dataclass
class _LogScan:
    """How far supervisord's log has been read, and the spawns counted in that part."""

    inode: int
    offset: int = 0
    spawned: collections.Counter[str] = field(default_factory=collections.Counter)


_scans: dict[Path, _LogScan] = {}
_scans_lock = threading.Lock()


def _spawn_counts(log: Path) -> collections.Counter[str]:
    """Spawns per program in `log`, reading only what was appended since the last call (the admin
    dashboard asks every few seconds); a rotated or truncated log is read again from its start."""
    with _scans_lock, log.open("rb") as handle:
        info = os.fstat(handle.fileno())
        scan = _scans.get(log)
        if scan is None or scan.inode != info.st_ino or info.st_size < scan.offset:
            scan = _scans[log] = _LogScan(inode=info.st_ino)
        handle.seek(scan.offset)
        appended = handle.read()
        complete = appended[:appended.rfind(b"\n") + 1]  # a line still being written waits
        scan.offset += len(complete)
        scan.spawned.update(SPAWNED.findall(complete.decode(errors="replace")))
        return collections.Counter(scan.spawned)


def runs_module(pid: int | None, module: str) -> bool:
    """Whether `pid` is a live process running Python module `module` other than this one (after
    a reboot a recorded number may be this process's, or another program's)."""
    if pid is None or pid == os.getpid():
        return False
    try:
        return module in psutil.Process(pid).cmdline() and pid_alive(pid)
    except psutil.Error:
        return False


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); it is gone for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
