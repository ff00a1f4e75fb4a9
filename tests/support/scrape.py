"""The gateway's /metrics as the appliance's Prometheus reads it, and what that Prometheus holds:
with the monitoring password."""

from __future__ import annotations

import json
from typing import Any

import httpx

from appliance.alerts import MONITORING_SECRET, MONITORING_USER, monitoring_auth
from appliance.home import Home
from appliance.secrets import secret
from appliance.tls import local_trust
from tests.support.appliances import Appliance


def gateway_metrics(url: str, home: Home) -> str:
    """The exposition at `url`/metrics of the appliance at `home`."""
    response = httpx.get(f"{url}/metrics", auth=(MONITORING_USER, secret(home, MONITORING_SECRET)), timeout=30)
    assert response.status_code == 200, response.text
    return response.text


def prometheus_url(appliance: Appliance) -> str:
    """Where the appliance's own Prometheus listens, as `appliance status` names it."""
    status = json.loads(appliance.run("status", "--json", timeout=60).stdout)
    [program] = [p for p in status["programs"] if p["name"] == "prometheus"]
    return str(program["urls"]["prometheus"])


def prometheus_get(appliance: Appliance, url: str, path: str, **params: str) -> Any:
    """The `data` of a Prometheus API answer, asked with the monitoring password."""
    answer = httpx.get(f"{url}{path}", params=params, auth=monitoring_auth(appliance.home),
                       verify=local_trust(appliance.home), timeout=10)
    answer.raise_for_status()
    return answer.json()["data"]


def prometheus_alerts(appliance: Appliance, url: str, name: str) -> list[dict[str, Any]]:
    """The alerts named `name` that the appliance's Prometheus holds now (pending or firing)."""
    return [a for a in prometheus_get(appliance, url, "/api/v1/alerts")["alerts"] if a["labels"]["alertname"] == name]
