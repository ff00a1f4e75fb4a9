"""Prometheus and Alertmanager, supervised on loopback: the appliance's metrics and alerts.

Both come from Debian's packages (`prometheus`, `prometheus-alertmanager`; bootstrap installs them
and a bundle's host needs them as it needs bubblewrap). Each listens on 127.0.0.1 only and asks
for a password, the appliance's generated MONITORING_SECRET (0600; the servers get its bcrypt hash
in their web configuration), so another local user can neither read the metrics nor silence or
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
from appliance.home import Home
from appliance.local_gateway import gateway_url
from appliance.programs import Program
from appliance.secrets import secret
from appliance.settings import MonitoringSettings, Settings
from appliance.tls import LOOPBACK_NAME, ca_file

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
    return f"http://127.0.0.1:{monitoring.prometheus_port}"


def _write(path: Path, document: dict[str, Any]) -> Path:
    """A configuration file, 0600 (it names the password file and the webhook): JSON, which both
    servers read as the YAML it is a subset of, and in which no setting can write a structure."""
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text(json.dumps(document, indent=2) + "\n")
    return path


def _auth(home: Home) -> dict[str, str]:
    return {"username": MONITORING_USER, "password_file": str(home.secrets / MONITORING_SECRET)}


def _web_config(home: Home, directory: Path) -> Path:
    hashed = bcrypt.hashpw(secret(home, MONITORING_SECRET).encode(), bcrypt.gensalt(rounds=10)).decode()
    return _write(directory / "web.yml", {"basic_auth_users": {MONITORING_USER: hashed}})


def prometheus_config(settings: Settings, home: Home) -> dict[str, Any]:
    """Prometheus's configuration: what it scrapes, its rules, where alerts go."""
    monitoring, interval = settings.monitoring, f"{settings.monitoring.scrape_interval_s}s"
    scheme, target = gateway_url(settings).split("://", 1)
    at_gateway: list[dict[str, Any]] = [
        {"job_name": "gateway", "scheme": scheme, "static_configs": [{"targets": [target]}]},
        # The engines' own metrics, relayed by the gateway (they listen on Unix sockets only).
        {"job_name": "engines", "scheme": scheme, "metrics_path": "/metrics/engines",
         "static_configs": [{"targets": [target]}]}]
    if settings.gateway.https:
        for job in at_gateway:
            job["tls_config"] = {"ca_file": str(ca_file(home)), "server_name": LOOPBACK_NAME}
    own = [{"job_name": name, "basic_auth": _auth(home), "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
           for name, port in (("prometheus", monitoring.prometheus_port),
                              ("alertmanager", monitoring.alertmanager_port))]
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(rules_file())],
        "alerting": {"alertmanagers": [{"basic_auth": _auth(home), "static_configs": [
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
