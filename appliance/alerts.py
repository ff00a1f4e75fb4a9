"""Firing alerts: what the appliance's Alertmanager holds (installer/monitoring.py runs it), as one
typed record for the admin API, the CLI and the TUI. Alertmanager listens on loopback and asks for
the appliance's monitoring password (MONITORING_SECRET), so only the host's appliance user, or an
administrator through the admin API, reads them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

import httpx
from pydantic import BaseModel, Field

from appliance.errors import Conflict, StateError, Unavailable
from appliance.home import Home
from appliance.secrets import secret
from appliance.settings import MonitoringSettings
from appliance.tls import local_trust

MONITORING_SECRET = "monitoring-password"
MONITORING_USER = "appliance"  # the one user of Prometheus's and Alertmanager's web configuration


class Alert(BaseModel):
    """One firing alert (appliance/alert_rules.yml names them)."""

    name: str
    severity: str = Field(description="page, ticket or none (the pipeline's heartbeat).")
    since: datetime
    summary: str
    labels: dict[str, str] = Field(default_factory=dict, description="What it is about (pool, replica, volume...).")


def alertmanager_url(monitoring: MonitoringSettings) -> str:
    return f"https://127.0.0.1:{monitoring.alertmanager_port}"


def monitoring_auth(home: Home) -> tuple[str, str]:
    return MONITORING_USER, secret(home, MONITORING_SECRET)


def _alert(found: dict[str, Any]) -> Alert:
    labels = {k: str(v) for k, v in found["labels"].items()}
    return Alert(name=labels.pop("alertname"), severity=labels.pop("severity", "none"), since=found["startsAt"],
                 summary=str(found.get("annotations", {}).get("summary", "")), labels=labels)


def firing(monitoring: MonitoringSettings, home: Home) -> list[Alert]:
    """The alerts firing now (not silenced or inhibited), the most urgent first."""
    if not monitoring.enabled:
        raise Conflict("monitoring is off (monitoring.enabled = false): there are no alerts to show")
    return firing_at(alertmanager_url(monitoring), home)


def firing_at(url: str, home: Home) -> list[Alert]:
    """The alerts the Alertmanager at `url` holds firing now, the most urgent first."""
    try:
        # The server is verified before the password goes: a local user on the port gets nothing.
        response = httpx.get(f"{url}/api/v2/alerts", auth=monitoring_auth(home), verify=local_trust(home),
                             params={"active": "true", "silenced": "false", "inhibited": "false"}, timeout=5)
        response.raise_for_status()
        alerts = [_alert(found) for found in response.json()]
    except (httpx.HTTPError, ValueError, KeyError, TypeError, StateError) as exc:
        raise Unavailable(f"Alertmanager at {url} did not list its alerts: {exc}",
                          hint="`appliance status` shows whether alertmanager runs") from exc
    order = {"page": 0, "ticket": 1}
    return sorted(alerts, key=lambda a: (order.get(a.severity, 2), a.since, a.name))


def is_heartbeat(alert: Mapping[str, Any]) -> bool:
    """The pipeline's heartbeat (Watchdog, severity none): by Alertmanager's convention it always
    fires while rules are evaluated and alerts delivered, so it is never counted as an alert; where
    it fires, the status, the TUI and `appliance alerts` all say "heartbeat ok"."""
    return bool(alert["severity"] == "none")


def summary(firing: Iterable[Mapping[str, Any]]) -> str:
    """What needs someone, in a line: the firing alerts but the heartbeat, and the heartbeat's
    state where it fires."""
    listed = list(firing)
    urgent = [f"{a['name']} ({a['severity']})" for a in listed if not is_heartbeat(a)]
    line = f"{len(urgent)} firing: {', '.join(urgent)}" if urgent else "none firing"
    return f"{line}; heartbeat ok" if any(map(is_heartbeat, listed)) else line
