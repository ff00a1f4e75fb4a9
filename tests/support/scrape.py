"""The gateway's /metrics as the appliance's Prometheus reads it: with the monitoring password."""

from __future__ import annotations

import httpx

from appliance.alerts import MONITORING_SECRET, MONITORING_USER
from appliance.home import Home
from appliance.secrets import secret


def gateway_metrics(url: str, home: Home) -> str:
    """The exposition at `url`/metrics of the appliance at `home`."""
    response = httpx.get(f"{url}/metrics", auth=(MONITORING_USER, secret(home, MONITORING_SECRET)), timeout=30)
    assert response.status_code == 200, response.text
    return response.text
