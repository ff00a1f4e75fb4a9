"""The gateway's probes of Keycloak and its PostgreSQL (serve.dependencies): what each answer
means, that a peer which accepts and never answers costs a probe its timeout and no more, and that
only the programs the last `up` started have series. Against the real servers:
tests/integration/test_dependency_alerts.py."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from appliance.home import Home
from appliance.programs import Program
from appliance.supervisor import ProcessInfo, ProcessState
from serve import dependencies
from serve.dependencies import DependencyProbes, accepting, startup_packet

HEALTH = "https://127.0.0.1:9180/health/ready"
LAST_UP = "appliance_dependency_last_up_timestamp_seconds"


def message(kind: bytes, body: bytes) -> bytes:
    return kind + struct.pack("!I", len(body) + 4) + body


def error(sqlstate: str) -> bytes:
    """An ErrorResponse's fields, as the server sends them."""
    return b"SFATAL\0VFATAL\0C" + sqlstate.encode() + b"\0Msome words\0\0"


@given(st.text(alphabet="0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ", min_size=5, max_size=5))
def test_a_refusal_other_than_cannot_connect_now_is_a_working_server(sqlstate: str) -> None:
    """As pg_isready judges: a server that refuses this login (no such role, wrong password, no
    pg_hba entry) works; one starting, stopping or in recovery (57P03) does not accept connections."""
    assert accepting(b"E", error(sqlstate)) == (sqlstate != "57P03")


@pytest.mark.parametrize(("kind", "body", "up"), [
    (b"R", struct.pack("!I", 10) + b"SCRAM-SHA-256\0\0", True),  # asks for the password: it works
    (b"R", struct.pack("!I", 0), True),  # trusts the client
    (b"E", error("57P03"), False),  # the database system is starting up
    (b"E", error("28P01"), True),
    (b"N", b"", False),  # not a startup answer
    (b"H", b"TTP/1.1 400", False),  # something else listens there
])
def test_the_first_answer_says_whether_the_server_accepts_connections(kind: bytes, body: bytes, up: bool) -> None:
    assert accepting(kind, body) is up


@given(st.text(alphabet=st.characters(min_codepoint=1, max_codepoint=0x2FF), min_size=1, max_size=40),
       st.text(alphabet=st.characters(min_codepoint=1, max_codepoint=0x2FF), min_size=1, max_size=40))
def test_the_startup_packet_is_protocol_3_with_role_and_database(role: str, database: str) -> None:
    packet = startup_packet(role, database)
    length, version = struct.unpack("!II", packet[:8])
    assert length == len(packet) and version == 196608
    assert packet[8:].split(b"\0") == [b"user", role.encode(), b"database", database.encode(), b"", b""]


class Listener:
    """A TCP listener on loopback that answers each connection with `answer(received)`, or never."""

    def __init__(self, answer: Callable[[bytes], bytes] | None) -> None:
        self.answer = answer
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.received: list[bytes] = []
        self.held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.server.accept()
            except OSError:
                return
            self.held.append(connection)  # a stopped server's connection stays open, unanswered
            if self.answer is not None:
                received = connection.recv(4096)
                self.received.append(received)
                answer = self.answer(received)
                if answer:
                    connection.sendall(answer)
                else:
                    connection.close()  # it hangs up

    def close(self) -> None:
        self.server.close()
        for connection in self.held:
            connection.close()


@pytest.fixture
def listener() -> Iterator[Callable[[Callable[[bytes], bytes] | None], Listener]]:
    made: list[Listener] = []

    def make(answer: Callable[[bytes], bytes] | None) -> Listener:
        made.append(Listener(answer))
        return made[-1]

    yield make
    for server in made:
        server.close()


def programs(home: Home, *started: Program) -> None:
    """What the last `up` started, as it records it."""
    (home.run / "programs.json").write_text(json.dumps([p.model_dump(mode="json") for p in started]))


def postgres(port: int, url: str | None = None) -> Program:
    return Program(name="postgres", command=["postgres"], port=port,
                   urls={"database": url or f"postgresql://keycloak@127.0.0.1:{port}/keycloak"})


KEYCLOAK = Program(name="keycloak", command=["kc.sh"], port=8180, health_url=HEALTH)


def series(probes: DependencyProbes) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(probes)
    found = {}
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith("appliance_dependency_up{"):
            name, value = line.split()
            found[name.split('"')[1]] = float(value)
    return found


def keycloak_answers(status: int, body: object) -> httpx.AsyncClient:
    def handle(request: httpx.Request) -> httpx.Response:
        assert str(request.url) == HEALTH
        return httpx.Response(status, json=body)
    return httpx.AsyncClient(transport=httpx.MockTransport(handle))


def probe(probes: DependencyProbes, http: httpx.AsyncClient) -> float:
    """One round of probes; how long it took."""
    began = time.monotonic()
    anyio.run(probes.probe, http)
    return time.monotonic() - began


def test_a_server_asking_for_the_password_is_up_and_asked_as_keycloaks_role(
        home: Home, listener: Callable[[Callable[[bytes], bytes] | None], Listener]) -> None:
    server = listener(lambda _: message(b"R", struct.pack("!I", 10) + b"SCRAM-SHA-256\0\0"))
    programs(home, postgres(server.port))
    probes = DependencyProbes(home)
    probe(probes, keycloak_answers(200, {}))
    assert series(probes) == {"postgres": 1.0}
    assert server.received == [startup_packet("keycloak", "keycloak")]


def test_a_server_that_accepts_and_never_answers_is_down_after_the_timeout(
        home: Home, listener: Callable[[Callable[[bytes], bytes] | None], Listener],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A stopped PostgreSQL: the kernel takes the connection, nothing answers it."""
    monkeypatch.setattr(dependencies, "PROBE_TIMEOUT_S", 0.5)
    stopped = listener(None)
    programs(home, postgres(stopped.port))
    probes = DependencyProbes(home)
    taken = probe(probes, keycloak_answers(200, {}))
    assert series(probes) == {"postgres": 0.0}
    assert taken < 30  # bounded by the timeout, not by the peer (a generous bound: a loaded machine)


@pytest.mark.parametrize("answer", [
    lambda _: message(b"E", error("57P03")),  # starting up
    lambda _: b"",  # closes at once
    lambda _: b"HTTP/1.1 400 Bad Request\r\n\r\n",  # not PostgreSQL
])
def test_a_server_not_accepting_connections_is_down(
        home: Home, listener: Callable[[Callable[[bytes], bytes] | None], Listener],
        answer: Callable[[bytes], bytes]) -> None:
    server = listener(answer)
    programs(home, postgres(server.port))
    probes = DependencyProbes(home)
    probe(probes, keycloak_answers(200, {}))
    assert series(probes) == {"postgres": 0.0}


def test_a_refused_connection_is_down(home: Home) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
    programs(home, postgres(port))
    probes = DependencyProbes(home)
    probe(probes, keycloak_answers(200, {}))
    assert series(probes) == {"postgres": 0.0}


@pytest.mark.parametrize("url", ["postgresql://127.0.0.1:5433", "postgresql://keycloak@127.0.0.1:5433",
                                 "postgresql://keycloak@127.0.0.1/keycloak", "http://keycloak@127.0.0.1:5433/k"])
def test_a_database_url_naming_no_role_or_database_is_not_probed(home: Home, url: str) -> None:
    """An appliance last started before its URL named them: no series rather than a made-up one."""
    programs(home, postgres(5433, url))
    probes = DependencyProbes(home)
    probe(probes, keycloak_answers(200, {}))
    assert series(probes) == {}


@pytest.mark.parametrize(("status", "body", "up"), [
    (200, {"status": "UP", "checks": [{"name": "Keycloak Initialized", "status": "UP"}]}, 1.0),
    (503, {"status": "DOWN", "checks": [{"name": "Keycloak Initialized", "status": "DOWN"}]}, 0.0),
    (200, {"status": "DOWN", "checks": []}, 0.0),
    (200, ["not", "an", "object"], 0.0),
    (404, {"status": "UP"}, 0.0),  # not its health endpoint
])
def test_keycloak_is_up_when_its_readiness_check_says_so(home: Home, status: int, body: object, up: float) -> None:
    programs(home, KEYCLOAK)
    probes = DependencyProbes(home)
    probe(probes, keycloak_answers(status, body))
    assert series(probes) == {"keycloak": up}


def test_an_answer_that_is_not_json_is_down(home: Home) -> None:
    programs(home, KEYCLOAK)
    probes = DependencyProbes(home)
    probe(probes, httpx.AsyncClient(transport=httpx.MockTransport(lambda _: httpx.Response(200, text="<html>"))))
    assert series(probes) == {"keycloak": 0.0}


def test_a_keycloak_that_never_answers_is_down_after_the_timeout(home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dependencies, "PROBE_TIMEOUT_S", 0.5)

    async def never(request: httpx.Request) -> httpx.Response:
        await anyio.sleep_forever()
        raise AssertionError

    programs(home, KEYCLOAK)
    probes = DependencyProbes(home)
    taken = probe(probes, httpx.AsyncClient(transport=httpx.MockTransport(never)))
    assert series(probes) == {"keycloak": 0.0}
    assert taken < 30


def test_only_what_the_last_up_started_is_probed_and_the_last_good_probe_is_kept(
        home: Home, listener: Callable[[Callable[[bytes], bytes] | None], Listener]) -> None:
    """An external Keycloak or PostgreSQL is no program of ours: no series, so no alert."""
    probes = DependencyProbes(home)
    probe(probes, keycloak_answers(200, {"status": "UP", "checks": []}))
    assert series(probes) == {}
    programs(home, KEYCLOAK)
    registry = CollectorRegistry()
    registry.register(probes)
    probe(probes, keycloak_answers(200, {"status": "UP", "checks": []}))
    good = registry.get_sample_value(LAST_UP, {"dependency": "keycloak"})
    assert good is not None and abs(good - time.time()) < 600
    probe(probes, keycloak_answers(503, {"status": "DOWN", "checks": []}))
    assert series(probes) == {"keycloak": 0.0}
    assert registry.get_sample_value(LAST_UP, {"dependency": "keycloak"}) == good
    programs(home)
    probe(probes, keycloak_answers(200, {"status": "UP", "checks": []}))
    assert series(probes) == {}


def running(name: str, pid: int, uptime_s: int, state: ProcessState = ProcessState.RUNNING) -> ProcessInfo:
    return ProcessInfo(name=name, state=state, pid=pid, uptime_s=uptime_s, log=Path("/dev/null"), description="")


def test_a_process_still_starting_is_judged_once_it_answered_or_its_start_timeout_passed(
        home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    """As the watchdog judges engines: Keycloak loading (at `up`, after a crash) is not reported
    down for its load time; once it answered, or past its start timeout, it is."""
    programs(home, KEYCLOAK)  # start_timeout_s: 120 (the default)
    probes = DependencyProbes(home)
    seen: list[ProcessInfo] = []
    monkeypatch.setattr(probes, "_processes", lambda: {info.name: info for info in seen})
    ready: object = {"status": "UP", "checks": []}
    loading: object = {"status": "DOWN", "checks": []}
    steps: list[tuple[ProcessInfo | None, int, object, dict[str, float]]] = [
        (running("keycloak", 100, 0, ProcessState.STARTING), 503, loading, {}),
        (running("keycloak", 100, 30), 503, loading, {}),  # loading: not judged yet
        (running("keycloak", 100, 60), 200, ready, {"keycloak": 1.0}),
        (running("keycloak", 100, 90), 503, loading, {"keycloak": 0.0}),  # answered once: judged
        (running("keycloak", 200, 10), 503, loading, {}),  # started again: judged afresh
        (running("keycloak", 200, 120), 503, loading, {"keycloak": 0.0}),  # its start timeout passed
        (running("keycloak", 200, 0, ProcessState.BACKOFF), 503, loading, {"keycloak": 0.0}),
        (None, 503, loading, {"keycloak": 0.0}),  # supervisord not answering: judged as it is
    ]
    for info, status, body, expected in steps:
        seen[:] = [info] if info is not None else []
        probe(probes, keycloak_answers(status, body))
        assert series(probes) == expected, (info, status)
