"""Prometheus and Alertmanager, supervised on loopback: the appliance's metrics and alerts.

Both come from Debian's packages (`prometheus`, `prometheus-alertmanager`; bootstrap installs them
and a bundle's host needs them as it needs bubblewrap). Each listens on 127.0.0.1 only, speaks
HTTPS with a certificate from the appliance's CA (so a local user who takes the port while a
server restarts gets no password: every client verifies the server first) and asks for a
password, the appliance's generated MONITORING_SECRET (0600; the servers get its bcrypt hash in
their web configuration), so another local user can neither read their metrics nor silence or
forge an alert. Prometheus scrapes the gateway and, through it, every engine replica (HTTPS
verified against the appliance's CA where the gateway serves it), itself and Alertmanager, evaluates the shipped rules
(appliance/alert_rules.yml) and sends what fires to Alertmanager, which posts it to
`monitoring.webhook_url` (appliance.alerts reads what fires). The configuration is written at
every `up` from the settings.
"""

from __future__ import annotations

import json
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

import bcrypt

from appliance.alerts import MONITORING_SECRET, MONITORING_USER, alertmanager_url
from appliance.durable import replace_file
from appliance.home import Home
from appliance.local_gateway import gateway_url
from appliance.programs import Program
from appliance.secrets import secret
from appliance.settings import MonitoringSettings, Settings
from appliance.tls import LOOPBACK_NAME, ca_file, ensure_server_certificate

INSTALL_HINT = ("apt-get install prometheus prometheus-alertmanager (bootstrap.sh does), or set "
                "monitoring.enabled = false")


def rules_file() -> Path:
    """The alert rules the appliance ships (promtool-tested in CI)."""
    return Path(str(resources.files("appliance") / "alert_rules.yml"))


def monitoring_dir(home: Home) -> Path:
    return home.root / "monitoring"


def binary(*names: str) -> str | None:
    return next((found for name in names if (found := shutil.which(name))), None)


def prometheus_url(monitoring: MonitoringSettings) -> str:
    return f"https://127.0.0.1:{monitoring.prometheus_port}"


def _write(path: Path, document: dict[str, Any]) -> Path:
    """A configuration file, 0600 (it names the password file and the webhook), replaced whole (the
    servers re-read their web configuration at each request: never one half written): JSON, which
    both servers read as the YAML it is a subset of, and in which no setting can write a structure."""
    replace_file(path, (json.dumps(document, indent=2) + "\n").encode(), mode=0o600)
    return path


def _client(home: Home) -> dict[str, Any]:
    """How Prometheus reaches either server: the password, and the server verified as the CA's."""
    return {"basic_auth": {"username": MONITORING_USER, "password_file": str(home.secrets / MONITORING_SECRET)},
            "tls_config": {"ca_file": str(ca_file(home)), "server_name": LOOPBACK_NAME}}


def _web_config(home: Home, directory: Path) -> Path:
    certificate, key = ensure_server_certificate(home, "monitoring")
    hashed = bcrypt.hashpw(secret(home, MONITORING_SECRET).encode(), bcrypt.gensalt(rounds=10)).decode()
    return _write(directory / "web.yml", {"tls_server_config": {"cert_file": str(certificate), "key_file": str(key)},
                                          "basic_auth_users": {MONITORING_USER: hashed}})


def prometheus_config(settings: Settings, home: Home) -> dict[str, Any]:
    """Prometheus's configuration: what it scrapes, its rules, where alerts go."""
    monitoring, interval = settings.monitoring, f"{settings.monitoring.scrape_interval_s}s"
    scheme, target = gateway_url(settings).split("://", 1)
    at_gateway: list[dict[str, Any]] = [
        {"job_name": "gateway", "scheme": scheme, "basic_auth": _client(home)["basic_auth"],
         "static_configs": [{"targets": [target]}]},
        # The engines' own metrics, relayed by the gateway (they listen on Unix sockets only) to
        # the monitoring password only, as the gateway's are; bounded, and nothing but the engines'
        # own families kept.
        {"job_name": "engines", "scheme": scheme, "metrics_path": "/metrics/engines",
         "basic_auth": _client(home)["basic_auth"], "static_configs": [{"targets": [target]}],
         "sample_limit": 200_000, "body_size_limit": "64MB", "label_limit": 16, "label_value_length_limit": 256,
         "metric_relabel_configs": [{"source_labels": ["__name__"], "regex": "vllm:.+|appliance_engine_scrape_up",
                                     "action": "keep"}]}]
    if settings.gateway.https:
        for job in at_gateway:
            job["tls_config"] = _client(home)["tls_config"]
    own = [{"job_name": name, "scheme": "https", **_client(home),
            "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
           for name, port in (("prometheus", monitoring.prometheus_port),
                              ("alertmanager", monitoring.alertmanager_port))]
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(rules_file())],
        "alerting": {"alertmanagers": [{"scheme": "https", **_client(home), "static_configs": [
            {"targets": [f"127.0.0.1:{monitoring.alertmanager_port}"]}]}]},
        "scrape_configs": [*at_gateway, *own],
    }


def alertmanager_config(monitoring: MonitoringSettings) -> dict[str, Any]:
    """Alertmanager's configuration: every alert to the webhook, if one is set."""
    receiver: dict[str, Any] = {"name": "operator"}
    if monitoring.webhook_url:
        receiver["webhook_configs"] = [{"url": monitoring.webhook_url, "send_resolved": True}]
    return {"route": {"receiver": "operator", "group_by": ["alertname"], "group_wait": "10s",
                      "group_interval": "1m", "repeat_interval": "4h"},
            "receivers": [receiver]}


def monitoring_programs(settings: Settings, home: Home) -> list[Program]:
    """The `appliance.programs` entry point: Prometheus and Alertmanager, unless turned off."""
    monitoring = settings.monitoring
    if not monitoring.enabled:
        return []
    prometheus, alertmanager = binary("prometheus"), binary("prometheus-alertmanager", "alertmanager")
    directory = monitoring_dir(home)
    directory.mkdir(mode=0o700, exist_ok=True)
    directory.chmod(0o700)
    secret(home, MONITORING_SECRET)  # made before either server reads it
    web = _web_config(home, directory)
    missing = None if prometheus else f"no prometheus binary: {INSTALL_HINT}"
    command = [prometheus or "prometheus",
               f"--config.file={_write(directory / 'prometheus.yml', prometheus_config(settings, home))}",
               f"--web.config.file={web}", f"--web.listen-address=127.0.0.1:{monitoring.prometheus_port}",
               f"--storage.tsdb.path={directory / 'prometheus'}",
               f"--storage.tsdb.retention.time={monitoring.retention_days}d",
               f"--storage.tsdb.retention.size={monitoring.retention_mb}MB"]
    servers = [Program(
        name="prometheus", command=command, port=monitoring.prometheus_port, priority=95, startsecs=2,
        health_url=f"{prometheus_url(monitoring)}/-/ready", health_password_secret=MONITORING_SECRET,
        urls={"prometheus": prometheus_url(monitoring)}, start_timeout_s=120,
        start_nice=settings.engine.yield_nice, missing=missing)]
    missing = None if alertmanager else f"no alertmanager binary: {INSTALL_HINT}"
    command = [alertmanager or "alertmanager",
               f"--config.file={_write(directory / 'alertmanager.yml', alertmanager_config(monitoring))}",
               f"--web.config.file={web}", f"--web.listen-address=127.0.0.1:{monitoring.alertmanager_port}",
               f"--storage.path={directory / 'alertmanager'}",
               "--cluster.listen-address="]  # no gossip port: one Alertmanager
    servers.append(Program(
        name="alertmanager", command=command, port=monitoring.alertmanager_port, priority=95, startsecs=2,
        health_url=f"{alertmanager_url(monitoring)}/-/ready", health_password_secret=MONITORING_SECRET,
        urls={"alertmanager": alertmanager_url(monitoring)}, start_timeout_s=120,
        start_nice=settings.engine.yield_nice, missing=missing))
    return servers
