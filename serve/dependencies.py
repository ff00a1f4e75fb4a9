"""Probes of what logins depend on, for the metrics: the embedded Keycloak's readiness and the
PostgreSQL the appliance supervises for it.

supervisord's RUNNING says a process exists, not that it answers: a stopped (SIGSTOP) or wedged
Keycloak or PostgreSQL stays RUNNING. Every PROBE_INTERVAL_S the gateway asks:
- `keycloak`: its management interface's /health/ready (the `keycloak` program's health URL),
  200 with status UP;
- `postgres`: the supervised server's answer to a connection on its loopback port, as pg_isready
  asks: a startup packet for Keycloak's role and database, up when the server asks for the
  password (no password is sent: the server logs nothing for a client that leaves there), down on
  no answer or "the database system is starting up" (or shutting down, or in recovery).
PostgreSQL is asked directly rather than through Keycloak's database check: Keycloak reports that
check only when built with metrics enabled, which the appliance's Keycloak is not.
Each probe ends after PROBE_TIMEOUT_S whatever the other side does. Only the programs the last `up`
started are probed: an external Keycloak or PostgreSQL is the organisation's to watch (its
management interface is not published to clients, and its server takes TLS and a password only),
and a program not ours has no series, so no alert.
"""

from __future__ import annotations

import logging
import struct
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass

import anyio
import httpx
from anyio.streams.buffered import BufferedByteReceiveStream
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from appliance.errors import SupervisorError
from appliance.home import Home
from appliance.lifecycle import started_programs
from appliance.programs import Program
from appliance.supervisor import ProcessInfo, ProcessState, Supervisor

log = logging.getLogger("appliance.gateway")
PROBE_INTERVAL_S = 5.0
PROBE_TIMEOUT_S = 3.0
PROTOCOL_3 = 196608  # the startup packet's protocol version, 3.0
CANNOT_CONNECT_NOW = "57P03"  # starting up, shutting down, in recovery: not accepting connections
MAX_ANSWER_BYTES = 4096


@dataclass(frozen=True)
class Probe:
    up: bool
    last_up_at: float | None  # Unix time of the last probe that passed; None: none yet
    pid: int  # the process probed, as supervisord reported it (0: not known)
    answered: bool  # that process has answered once
    judged: bool  # False while that process starts and has not answered yet: no series


class DependencyProbes(Collector):
    """The latest probe of each dependency (written by `watch`, read at each scrape).

    As the watchdog judges engines: a process still starting (within its program's start timeout)
    is judged only once it has answered, so a Keycloak loading at `up` or after a crash is not
    reported down for its load time (supervisord's state says whether it runs meanwhile)."""

    def __init__(self, home: Home) -> None:
        self.home, self.supervisor = home, Supervisor(home)
        self._probes: dict[str, Probe] = {}

    async def watch(self, keycloak: httpx.AsyncClient) -> None:
        """Probe every PROBE_INTERVAL_S, as long as the gateway runs (`keycloak`: a client of its
        own, which trusts the embedded Keycloak's certificate)."""
        while True:
            await self.probe(keycloak)
            await anyio.sleep(PROBE_INTERVAL_S)

    async def probe(self, http: httpx.AsyncClient) -> None:
        """Probe each dependency the last `up` started, all at once, each for at most PROBE_TIMEOUT_S."""
        programs = {program.name: program for program in await anyio.to_thread.run_sync(started_programs, self.home)}
        processes = await anyio.to_thread.run_sync(self._processes)
        results: dict[str, bool] = {}

        async def keycloak(program: Program) -> None:
            results["keycloak"] = await _keycloak_ready(http, program)

        async def postgres(target: tuple[str, int, str, str]) -> None:
            results["postgres"] = await _postgres_answers(*target)

        async with anyio.create_task_group() as probes:
            if (found := programs.get("keycloak")) is not None and found.health_url:
                probes.start_soon(keycloak, found)
            if (found := programs.get("postgres")) is not None and (target := _database_target(found)):
                probes.start_soon(postgres, target)
        now = time.time()
        probes_now: dict[str, Probe] = {}
        for name, up in results.items():
            info = processes.get(name)
            before = self._probes.get(name)
            pid = info.pid if info is not None else 0
            answered = up or (before is not None and before.pid == pid and before.answered)
            starting = info is not None and (info.state == ProcessState.STARTING or (
                info.state == ProcessState.RUNNING and info.uptime_s < programs[name].start_timeout_s))
            probes_now[name] = Probe(up=up, last_up_at=now if up else before.last_up_at if before else None,
                                     pid=pid, answered=answered, judged=answered or not starting)
        self._probes = probes_now

    def _processes(self) -> dict[str, ProcessInfo]:
        """supervisord's programs by name; none if it does not answer (every probe is judged then)."""
        try:
            return {info.name: info for info in self.supervisor.processes()}
        except SupervisorError as exc:
            log.debug("supervisord not readable for the dependency probes: %s", exc)
            return {}

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("appliance_dependency_up", "Whether a dependency the appliance runs answered its "
                               "latest probe (keycloak: /health/ready; postgres: a connection answered). No "
                               "series: not probed, or starting and not answered yet.", labels=["dependency"])
        last = GaugeMetricFamily("appliance_dependency_last_up_timestamp_seconds", "When a dependency last "
                                 "answered its probe (Unix time; no series: not since the gateway started).",
                                 labels=["dependency"])
        for name, probe in sorted(self._probes.items()):
            if probe.judged:
                up.add_metric([name], float(probe.up))
            if probe.last_up_at is not None:
                last.add_metric([name], probe.last_up_at)
        yield from (up, last)


async def _keycloak_ready(http: httpx.AsyncClient, program: Program) -> bool:
    """Whether Keycloak answers its readiness check 200, status UP."""
    assert program.health_url is not None
    try:
        with anyio.fail_after(PROBE_TIMEOUT_S):
            answer = await http.get(program.health_url)
            if answer.status_code != 200:
                log.info("Keycloak's readiness probe: %d", answer.status_code)
                return False
            body = answer.json()
    except (TimeoutError, httpx.HTTPError, ValueError) as exc:
        log.info("Keycloak's readiness probe failed: %s", exc or type(exc).__name__)
        return False
    return isinstance(body, dict) and body.get("status") == "UP"


def _database_target(program: Program) -> tuple[str, int, str, str] | None:
    """Host, port, role and database of the supervised server, from its program's database URL
    (postgresql://ROLE@127.0.0.1:PORT/DATABASE); None if it names no role or database."""
    url = urllib.parse.urlsplit(program.urls.get("database", ""))
    try:
        port = url.port
    except ValueError:
        return None
    database = url.path.removeprefix("/")
    if url.scheme != "postgresql" or not url.hostname or port is None or not url.username or not database:
        return None
    return url.hostname, port, url.username, database


async def _postgres_answers(host: str, port: int, role: str, database: str) -> bool:
    """Whether the server answers a connection as one accepting them (pg_isready's question)."""
    try:
        with anyio.fail_after(PROBE_TIMEOUT_S):
            async with await anyio.connect_tcp(host, port) as stream:
                await stream.send(startup_packet(role, database))
                answer = BufferedByteReceiveStream(stream)
                kind, length = struct.unpack("!cI", await answer.receive_exactly(5))
                if kind not in (b"R", b"E"):  # not PostgreSQL's first answer: what follows does not matter
                    return False
                body = await answer.receive_exactly(min(max(length - 4, 0), MAX_ANSWER_BYTES))
    except (TimeoutError, OSError, anyio.BrokenResourceError, anyio.EndOfStream, anyio.IncompleteRead) as exc:
        log.info("PostgreSQL's probe on %s:%d failed: %s", host, port, exc or type(exc).__name__)
        return False
    return accepting(kind, body)


def startup_packet(role: str, database: str) -> bytes:
    """Protocol 3.0's first message: its length, the version, then name/value pairs, NUL-ended."""
    pairs = b"".join(f"{name}\0{value}\0".encode() for name, value in (("user", role), ("database", database)))
    body = struct.pack("!I", PROTOCOL_3) + pairs + b"\0"
    return struct.pack("!I", len(body) + 4) + body


def accepting(kind: bytes, body: bytes) -> bool:
    """Whether the server's first answer says it accepts connections: it asks for authentication
    ('R'), or refuses with anything but "cannot connect now" (this login is refused, but the server
    works: as pg_isready judges)."""
    if kind == b"R":
        return True
    if kind != b"E":
        return False
    fields = {part[:1]: part[1:] for part in body.split(b"\0") if part}
    return fields.get(b"C") != CANNOT_CONNECT_NOW.encode()
