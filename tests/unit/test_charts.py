"""The dashboard's key series (appliance/charts.py): each one of the Grafana dashboard's own
expressions, read from a stand-in Prometheus over HTTPS with the appliance's CA and password; its
result series combined a step at a time, gaps, NaN and infinities kept as no sample; off, silent,
refusing or unreadable Prometheus said plainly."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlsplit

import pytest

from appliance import charts
from appliance.alerts import MONITORING_SECRET
from appliance.errors import Conflict, Invalid, Unavailable
from appliance.home import Home
from appliance.settings import MonitoringSettings
from appliance.tls import ensure_ca, ensure_server_certificate
from tests.support.certificates import serve_tls
from tests.support.ports import free_port

GRAFANA = Path(__file__).parents[2] / "docs" / "operate" / "grafana" / "appliance.json"
NOW = 1_800_000_007  # on no step: the window ends at the step before
BY_NAME = {chart.name: chart for chart in charts.CHARTS}

# A result series as the test gives it: its labels and its values by step index (strings, as
# Prometheus writes them).
Result = tuple[dict[str, str], dict[int, str]]


class FakePrometheus(BaseHTTPRequestHandler):
    """/api/v1/query_range for the password `right`: per expression, result series set by the test
    (timestamps from the request's own start and step), or a raw answer."""

    results: ClassVar[dict[str, list[Result]]]
    raw: ClassVar[dict[str, tuple[int, bytes]]]
    asked: ClassVar[list[dict[str, str]]]
    passwords: ClassVar[list[str]]

    def do_GET(self) -> None:
        self.passwords.append(self.headers.get("Authorization", ""))
        if self.headers.get("Authorization") != "Basic " + base64.b64encode(b"appliance:right").decode():
            self.answer(401, b"Unauthorized\n")
            return
        url = urlsplit(self.path)
        params = {key: values[0] for key, values in parse_qs(url.query).items()}
        self.asked.append(params)
        expression = params["query"]
        if url.path != "/api/v1/query_range":
            self.answer(404, b"404 page not found\n")
        elif expression in self.raw:
            self.answer(*self.raw[expression])
        else:
            start, step = float(params["start"]), float(params["step"])
            result = [{"metric": labels, "values": [[start + i * step, value] for i, value in sorted(values.items())]}
                      for labels, values in self.results.get(expression, [])]
            self.answer(200, json.dumps({"status": "success",
                                         "data": {"resultType": "matrix", "result": result}}).encode())

    def answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


Fake = tuple[MonitoringSettings, type[FakePrometheus]]


def fake_handler() -> type[FakePrometheus]:
    return type("Handler", (FakePrometheus,), {"results": {}, "raw": {}, "asked": [], "passwords": []})


@pytest.fixture
def prometheus(home: Home) -> Iterator[Fake]:
    """A Prometheus with the certificate `up` gives the real one (the appliance's CA's)."""
    handler = fake_handler()
    server = serve_tls(handler, *ensure_server_certificate(home, "monitoring"))
    (home.secrets / MONITORING_SECRET).write_text("right")
    (home.secrets / MONITORING_SECRET).chmod(0o600)
    yield MonitoringSettings(prometheus_port=server.server_address[1]), handler
    server.shutdown()
    server.server_close()


def grafana_expressions() -> set[str]:
    def targets(panels: list[dict[str, Any]]) -> Iterator[str]:
        for panel in panels:
            yield from targets(panel.get("panels", []))
            yield from (target["expr"] for target in panel.get("targets", []))

    return set(targets(json.loads(GRAFANA.read_text())["panels"]))


def test_every_chart_is_one_of_the_grafana_dashboard_s_expressions() -> None:
    expressions = grafana_expressions()
    for chart in charts.CHARTS:
        assert chart.expression in expressions, f"{chart.name}: not the Grafana dashboard's {chart.expression!r}"
    assert len({chart.name for chart in charts.CHARTS}) == len(charts.CHARTS)
    assert {"requests", "server_errors", "latency_p50", "ttft_p95", "tokens_out", "kv_cache",
            "engine_waiting"} <= set(BY_NAME)
    assert all(len(chart.label) <= 14 for chart in charts.CHARTS), "a label fits the dashboard's column"


def test_each_series_is_its_results_combined_a_step_at_a_time(home: Home, prometheus: Fake) -> None:
    settings, handler = prometheus
    handler.results = {
        BY_NAME["requests"].expression: [({"status": "200"}, {0: "1.5", 1: "2", 3: "0.5"}),
                                         ({"status": "503"}, {1: "0.25", 2: "NaN"})],
        BY_NAME["server_errors"].expression: [({}, {0: "NaN", 1: "0.125", 2: "+Inf", 3: "-Inf"})],
        BY_NAME["kv_cache"].expression: [({"pool": "main", "replica": "main"}, {0: "0.25", 3: "0.5"}),
                                         ({"pool": "main", "replica": "main-1"}, {0: "0.75", 3: "0.125"})],
        BY_NAME["tokens_out"].expression: [({"direction": "in"}, {2: "100"}), ({"direction": "out"}, {2: "40"})],
        BY_NAME["latency_p50"].expression: [({}, {-1: "9", 4: "9", 1: "0.02"})],  # outside the window: not shown
    }
    found = charts.series(settings, home, minutes=1, step_s=20, now=NOW)
    assert [s.name for s in found] == [chart.name for chart in charts.CHARTS], "every series, in order"
    shown = {s.name: s.points for s in found}
    assert shown["requests"] == [1.5, 2.25, None, 0.5], "summed where there are samples, None where none"
    assert shown["server_errors"] == [None, 0.125, None, None], "NaN and infinities are no sample"
    assert shown["kv_cache"] == [0.75, None, None, 0.5], "the fullest replica"
    assert shown["tokens_out"] == [None, None, 40.0, None], "only the direction out"
    assert shown["latency_p50"] == [None, 0.02, None, None]
    assert shown["engine_waiting"] == [None] * 4, "no result series: no sample at all"
    requests = found[0]
    assert (requests.label, requests.unit, requests.step_s) == ("requests/s", "req/s", 20)
    end = NOW // 20 * 20
    assert requests.start.timestamp() == end - 60
    assert handler.asked[0] == {"query": BY_NAME["requests"].expression, "start": str(end - 60), "end": str(end),
                                "step": "20"}
    assert len(handler.asked) == len(charts.CHARTS)


def test_the_points_are_capped(home: Home, prometheus: Fake) -> None:
    settings, handler = prometheus
    found = charts.series(settings, home, minutes=60, step_s=15)
    assert all(len(s.points) == charts.MAX_POINTS for s in found)
    with pytest.raises(Invalid, match=f"at most {charts.MAX_POINTS}"):
        charts.series(settings, home, minutes=61, step_s=15)
    with pytest.raises(Invalid):
        charts.series(settings, home, minutes=15, step_s=0)


@pytest.mark.parametrize(("status", "answer", "said"), [
    (200, b"{not json", "Expecting property name"),
    (400, b'{"status": "error", "errorType": "bad_data", "error": "parse error"}', "HTTP 400: parse error"),
    (200, b'{"status": "success", "data": {"resultType": "vector", "result": []}}', "a vector where"),
    (200, b'{"status": "success", "data": {"resultType": "matrix", "result": [{"values": [[1, null]]}]}}', "float"),
    (200, b'[]', "not a successful answer"),
    (200, b'{"status": "success", "data": {"resultType": "matrix", "result": ["x"]}}', "no attribute"),
    (503, b"Service Unavailable", "503"),
])
def test_an_answer_that_is_not_prometheus_s_is_unavailable(home: Home, prometheus: Fake, status: int, answer: bytes,
                                                           said: str) -> None:
    settings, handler = prometheus
    handler.raw = {BY_NAME["latency_p50"].expression: (status, answer)}
    with pytest.raises(Unavailable, match="did not answer the latency_p50 series") as raised:
        charts.series(settings, home)
    assert said in raised.value.message and raised.value.hint and "prometheus" in raised.value.hint


def test_a_wrong_password_or_no_prometheus_is_unavailable_and_off_is_said(home: Home, prometheus: Fake) -> None:
    settings, _ = prometheus
    (home.secrets / MONITORING_SECRET).write_text("wrong")
    with pytest.raises(Unavailable, match="401"):
        charts.series(settings, home)
    with pytest.raises(Unavailable, match="did not answer the requests series"):
        charts.series(MonitoringSettings(prometheus_port=free_port()), home)
    with pytest.raises(Conflict, match="monitoring is off"):
        charts.series(MonitoringSettings(enabled=False), home)


def test_a_server_the_appliance_s_ca_did_not_certify_gets_no_password(home: Home, tmp_path: Path) -> None:
    """A local user who takes Prometheus's port (while it restarts) with a certificate of their own:
    the client refuses it before sending the password."""
    ensure_ca(home)
    (home.secrets / MONITORING_SECRET).write_text("right")
    (home.secrets / MONITORING_SECRET).chmod(0o600)
    squatter = Home(tmp_path / "squatter").ensure()  # another CA, with the same names
    handler = fake_handler()
    server = serve_tls(handler, *ensure_server_certificate(squatter, "monitoring"))
    try:
        with pytest.raises(Unavailable, match="CERTIFICATE_VERIFY_FAILED"):
            charts.series(MonitoringSettings(prometheus_port=server.server_address[1]), home)
        assert handler.passwords == [], "the password never went"
    finally:
        server.shutdown()
        server.server_close()


def test_dashboards_refreshing_at_once_hold_one_thread_and_share_one_answer(home: Home,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """However many dashboards ask (or however slow Prometheus is), charts use one thread and ask
    Prometheus once a window: the gateway's thread pool stays free for /v1."""
    import anyio

    from appliance.settings import Settings
    from serve.routes import charts as charts_route

    running, most, calls = [0], [0], [0]
    lock = threading.Lock()

    def slow_series(*args: object) -> list[charts.Series]:
        with lock:
            running[0] += 1
            calls[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.3)
        with lock:
            running[0] -= 1
        return []

    monkeypatch.setattr(charts, "series", slow_series)
    [route] = charts_route.router(Settings(), home).routes
    endpoint = route.endpoint  # type: ignore[attr-defined]

    async def many() -> None:
        async with anyio.create_task_group() as tasks:
            for _ in range(20):
                tasks.start_soon(endpoint, 15, 15)

    anyio.run(many)
    assert most[0] == 1 and calls[0] <= 2  # one at a time; the callers of one window share its answer
