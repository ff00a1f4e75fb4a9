"""The shipped alert rules and the monitoring servers' configuration: promtool checks the rules and
runs their tests (tests/unit/promtool/), every metric a rule names is one the gateway exports, and
the configuration written at `up` is what promtool and amtool accept, private and password-guarded."""

from __future__ import annotations

import base64
import errno
import importlib.util
import json
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import bcrypt
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client import generate_latest

import audit.writer as writer_module
from appliance import alerts
from appliance.alerts import MONITORING_SECRET
from appliance.errors import Conflict, Unavailable
from appliance.home import Home
from appliance.secrets import secret
from appliance.settings import MonitoringSettings, Settings
from appliance.tls import ensure_ca, ensure_server_certificate
from audit import AuditEvent, AuditUnavailable, AuditWriter
from installer import monitoring
from serve.dependencies import DependencyProbes
from serve.engine_metrics import relabelled
from serve.metrics import ClusterCollector, Metrics, ProgramCollector, QueueCollector, StateCollector
from tests.support.certificates import serve_tls
from tests.support.nvml import build_fake_nvml, gpu_metrics
from tests.support.ports import free_port

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian's prometheus package) is not installed")
TESTS = Path(__file__).parent / "promtool" / "alert_rules_test.yml"
GRAFANA = Path(__file__).parents[2] / "docs" / "operate" / "grafana" / "appliance.json"
# What a rule names: a metric (a word before `{`, `[`, a space or the end) of the gateway's or the appliance's.
NAMED = re.compile(r"\b((?:gateway|appliance)_[a-z_]+?)(?:_bucket)?\b(?=[{\[\s)]|$)")
VLLM_NAMED = re.compile(r"\b(vllm:[a-z_]+)")


def exported(home: Home) -> set[str]:
    """Every metric name the gateway's /metrics serves, its state, queue and GPU collectors'
    included (the GPUs read through the stand-in NVML library)."""
    metrics = Metrics()
    writer = AuditWriter(home.audit, Ed25519PrivateKey.generate())
    ensure_ca(home)
    metrics.registry.register(StateCollector(home, writer, None))
    metrics.registry.register(QueueCollector(home))
    metrics.registry.register(ClusterCollector(home, []))
    metrics.registry.register(ProgramCollector(home))  # supervisord not running: its families, empty
    metrics.registry.register(DependencyProbes(home))  # nothing probed yet: its families, empty
    text = generate_latest(metrics.registry).decode() + relabelled([]).decode()  # /metrics and /metrics/engines
    text += gpu_metrics(home.root, build_fake_nvml(home.root))
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def unexported(expressions: str, home: Home) -> set[str]:
    """The metrics `expressions` name that neither the gateway (/metrics, /metrics/engines) nor the
    installed vLLM (relayed by serve.engine_metrics) exports."""
    vllm = importlib.util.find_spec("vllm")  # found, not imported (seconds of CPU)
    assert vllm is not None and vllm.origin is not None
    source = (Path(vllm.origin).parent / "v1" / "metrics" / "loggers.py").read_text()
    engines = {name for name in VLLM_NAMED.findall(expressions)
               if f'"{name.removesuffix("_total").removesuffix("_bucket")}"' not in source}
    return (set(NAMED.findall(expressions)) - exported(home)) | engines


def test_every_metric_a_rule_names_is_exported(home: Home) -> None:
    rules = monitoring.rules_file().read_text()
    assert len(NAMED.findall(rules)) >= 8 and len(VLLM_NAMED.findall(rules)) >= 4
    assert not unexported(rules, home), f"rules name metrics nothing exports: {sorted(unexported(rules, home))}"


def test_every_grafana_panel_queries_exported_metrics(home: Home) -> None:
    """The dashboard for operators who run Grafana (docs/operate/grafana/appliance.json)."""
    dashboard = json.loads(GRAFANA.read_text())
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert len(expressions) >= 12 and all(NAMED.search(e) or VLLM_NAMED.search(e) for e in expressions)
    missing = unexported("\n".join(expressions), home)
    assert not missing, f"panels query metrics nothing exports: {sorted(missing)}"


@pytest.mark.integration
@needs_promtool
def test_promtool_checks_the_rules_and_their_tests_pass() -> None:
    checked = subprocess.run([str(PROMTOOL), "check", "rules", str(monitoring.rules_file())],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run([str(PROMTOOL), "test", "rules", TESTS.name], cwd=TESTS.parent,
                            capture_output=True, text=True, timeout=120)
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr
    # Each alert of the file is tested.
    alerts = set(re.findall(r"^\s+- alert: (\w+)", monitoring.rules_file().read_text(), re.MULTILINE))
    assert alerts <= set(re.findall(r"alertname: (\w+)", TESTS.read_text()))


def test_the_configuration_guards_both_servers_and_trusts_the_gateways_ca(home: Home) -> None:
    settings = Settings(gateway={"tls": "on"}, monitoring={"webhook_url": "https://hooks.example.org/alerts"})
    programs = {p.name: p for p in monitoring.monitoring_programs(settings, home)}
    assert set(programs) == {"prometheus", "alertmanager"}
    directory = monitoring.monitoring_dir(home)
    for name in ("prometheus.yml", "alertmanager.yml", "web.yml"):
        assert stat.S_IMODE((directory / name).stat().st_mode) == 0o600, name
    web = json.loads((directory / "web.yml").read_text())
    password = secret(home, MONITORING_SECRET)
    assert bcrypt.checkpw(password.encode(), web["basic_auth_users"]["appliance"].encode())
    for program in programs.values():
        assert password not in " ".join(program.command), "the password is never in argv"
        assert any(arg.startswith("--web.listen-address=127.0.0.1:") for arg in program.command)
        assert program.health_password_secret == MONITORING_SECRET
    config = json.loads((directory / "prometheus.yml").read_text())
    [gateway] = [job for job in config["scrape_configs"] if job["job_name"] == "gateway"]
    assert gateway["scheme"] == "https" and gateway["tls_config"]["server_name"] == "localhost"
    assert gateway["basic_auth"]["password_file"].endswith(MONITORING_SECRET), "the gateway's /metrics is not public"
    assert config["alerting"]["alertmanagers"][0]["basic_auth"]["password_file"].endswith(MONITORING_SECRET)
    routed = json.loads((directory / "alertmanager.yml").read_text())
    assert routed["receivers"][0]["webhook_configs"][0]["url"] == "https://hooks.example.org/alerts"


def test_missing_servers_name_the_package(home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    programs = monitoring.monitoring_programs(Settings(), home)
    assert all("apt-get install prometheus prometheus-alertmanager" in (p.missing or "") for p in programs)
    assert monitoring.monitoring_programs(Settings(monitoring={"enabled": False}), home) == []


@pytest.mark.parametrize("url", ["http://10.1.2.3/alerts", "https://user:pw@hooks.example.org/",
                                 "ftp://hooks.example.org/", "https://hooks.example.org:99999/",
                                 "https://hooks.example.org/\u2028x", "https://hook s.example.org/",
                                 " https://hooks.example.org/", "https://hooks.example.org:0/",
                                 "https://hooks.example.org/" + "a" * 2100])
def test_a_bad_webhook_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="webhook_url"):
        MonitoringSettings(webhook_url=url)


@pytest.mark.integration
@needs_promtool
def test_promtool_and_amtool_accept_the_written_configuration(home: Home) -> None:
    monitoring.monitoring_programs(Settings(monitoring={"webhook_url": "http://127.0.0.1:9/hook"}), home)
    directory = monitoring.monitoring_dir(home)
    checked = subprocess.run([str(PROMTOOL), "check", "config", str(directory / "prometheus.yml")],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    checked = subprocess.run([str(PROMTOOL), "check", "web-config", str(directory / "web.yml")],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    amtool = shutil.which("amtool")
    assert amtool is not None
    checked = subprocess.run([amtool, "check-config", str(directory / "alertmanager.yml")],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr


class FakeAlertmanager(BaseHTTPRequestHandler):
    """Alertmanager's /api/v2/alerts for the password `right`, an answer set by the test."""

    answer: bytes = b"[]"
    passwords: list[str]  # every Authorization header it was sent

    def do_GET(self) -> None:
        expected = "Basic " + base64.b64encode(b"appliance:right").decode()
        self.passwords.append(self.headers.get("Authorization", ""))
        if self.headers.get("Authorization") != expected:
            self.send_response(401)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.answer)

    def log_message(self, *args: object) -> None:
        pass


Fake = tuple[MonitoringSettings, type[FakeAlertmanager]]


@pytest.fixture
def alertmanager(home: Home) -> Iterator[Fake]:
    """An Alertmanager with the certificate `up` gives the real one (the appliance's CA's)."""
    handler = type("Handler", (FakeAlertmanager,), {"passwords": []})
    server = serve_tls(handler, *ensure_server_certificate(home, "monitoring"))
    (home.secrets / MONITORING_SECRET).write_text("right")
    (home.secrets / MONITORING_SECRET).chmod(0o600)
    yield MonitoringSettings(alertmanager_port=server.server_address[1]), handler
    server.shutdown()
    server.server_close()


def raw(name: str, severity: str, since: str, **labels: str) -> dict[str, object]:
    return {"labels": {"alertname": name, "severity": severity, **labels}, "startsAt": since,
            "annotations": {"summary": f"{name} [b]bold[/b]"}, "status": {"state": "active"}}


def test_firing_alerts_come_most_urgent_first(home: Home, alertmanager: Fake) -> None:
    settings, handler = alertmanager
    handler.answer = json.dumps([raw("Watchdog", "none", "2026-12-03T10:00:00Z"),
                                 raw("DiskNearFull", "page", "2026-12-03T11:00:00Z", volume="state"),
                                 raw("CertificateNearExpiry", "ticket", "2026-12-03T09:00:00Z")]).encode()
    found = alerts.firing(settings, home)
    assert [a.name for a in found] == ["DiskNearFull", "CertificateNearExpiry", "Watchdog"]
    assert found[0].labels == {"volume": "state"} and found[0].summary == "DiskNearFull [b]bold[/b]"


@pytest.mark.parametrize("answer", [b"{not json", b'{"labels": 1}', b'[{"labels": {}}]', b'[{"startsAt": "x"}]'])
def test_an_answer_that_is_not_alertmanagers_is_unavailable(home: Home, alertmanager: Fake,
                                                            answer: bytes) -> None:
    settings, handler = alertmanager
    handler.answer = answer
    with pytest.raises(Unavailable, match="did not list its alerts"):
        alerts.firing(settings, home)


def test_a_wrong_password_or_no_alertmanager_is_unavailable_and_off_is_said(
        home: Home, alertmanager: Fake) -> None:
    settings, _ = alertmanager
    (home.secrets / MONITORING_SECRET).write_text("wrong")
    with pytest.raises(Unavailable, match="401"):
        alerts.firing(settings, home)
    with pytest.raises(Unavailable):
        alerts.firing(MonitoringSettings(alertmanager_port=free_port()), home)
    with pytest.raises(Conflict, match="monitoring is off"):
        alerts.firing(MonitoringSettings(enabled=False), home)


def test_a_server_the_appliances_ca_did_not_certify_gets_no_password(home: Home, tmp_path: Path) -> None:
    """A local user who takes Alertmanager's port (while it restarts) with a certificate of their
    own: the client refuses it before sending the password."""
    ensure_ca(home)
    squatter = Home(tmp_path / "squatter").ensure()  # another CA, with the same names
    handler: type[FakeAlertmanager] = type("Handler", (FakeAlertmanager,), {"passwords": []})
    server = serve_tls(handler, *ensure_server_certificate(squatter, "monitoring"))
    try:
        with pytest.raises(Unavailable, match="CERTIFICATE_VERIFY_FAILED"):
            alerts.firing(MonitoringSettings(alertmanager_port=server.server_address[1]), home)
        assert handler.passwords == [], "the password never went"
    finally:
        server.shutdown()
        server.server_close()


def test_a_full_audit_disk_shows_in_what_an_alert_can_hold(home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer clears its failure to let a write try again (so gateway_audit_writable flaps while
    the disk stays full): the count of failed writes only grows and the time of the last write
    stays put until a write succeeds, whatever the retries."""
    writer = AuditWriter(home.audit, Ed25519PrivateKey.generate())
    metrics = Metrics()
    metrics.registry.register(StateCollector(home, writer, None))

    def sample(name: str) -> float:
        value = metrics.registry.get_sample_value(name)
        assert value is not None, name
        return value

    event = AuditEvent(request_id="r", subject="s", client="c", action="chat.completions", outcome="allowed",
                       status=200)
    writer.append(event)
    written_at = sample("gateway_audit_last_write_timestamp_seconds")
    assert sample("gateway_audit_write_failures_total") == 0

    class FullDisk:
        """The writer's `os`, its writes failing as on a full disk."""

        def __getattr__(self, name: str) -> object:
            return getattr(os, name)

        @staticmethod
        def write(fd: int, data: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer_module, "os", FullDisk())
    monkeypatch.setattr(writer_module, "RETRY_AFTER_S", 0.0)  # each append tries again
    writable, failures = [], []
    for _ in range(5):
        with pytest.raises(AuditUnavailable, match="No space left"):
            writer.append(event)
        failures.append(sample("gateway_audit_write_failures_total"))
        writer.check()  # what /readyz and each request do: the failure is let go, to be tried again
        writable.append(sample("gateway_audit_writable"))
        assert sample("gateway_audit_last_write_timestamp_seconds") == written_at
    assert writable == [1.0] * 5, "between retries the flag says writable: no alert can hold on it"
    assert failures == [1, 2, 3, 4, 5]
    monkeypatch.undo()
    writer.append(event)
    assert sample("gateway_audit_last_write_timestamp_seconds") > written_at
    assert sample("gateway_audit_write_failures_total") == 5
