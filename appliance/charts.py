"""The dashboard's key series, read from the appliance's Prometheus (installer/monitoring.py runs
it) over a recent window: a fixed set of named charts, each one of the Grafana dashboard's own
expressions (docs/operate/grafana/appliance.json), so the terminal UI shows what Grafana would.
Clients name no PromQL: they get these series. Prometheus listens on loopback and asks for the
monitoring password, as Alertmanager does (appliance/alerts.py)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import httpx
from pydantic import BaseModel, Field

from appliance.alerts import monitoring_auth
from appliance.errors import Conflict, Invalid, StateError, Unavailable
from appliance.home import Home
from appliance.settings import MonitoringSettings
from appliance.tls import local_trust

STEP_S = 15  # the default step: Prometheus's default scrape interval
MINUTES = 15  # the default window
MAX_POINTS = 241  # per series (Prometheus allows 11,000; a terminal row is far narrower)
TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Chart:
    """One key series: a Grafana panel's expression, and how its result series make one line."""

    name: str
    label: str
    expression: str  # exactly as in docs/operate/grafana/appliance.json
    unit: Literal["req/s", "ratio", "s", "tok/s", "requests"]
    # How the result series make one point a step: summed (rates, counts), or the largest (a
    # share or a percentile per model or replica, where a sum would mean nothing).
    combine: Literal["sum", "max"] = "sum"
    only: tuple[tuple[str, str], ...] = ()  # keep only the result series with these labels


CHARTS: tuple[Chart, ...] = (
    Chart("requests", "requests/s", 'sum by (status) (rate(gateway_requests_total{route=~"/v1/.*"}[5m]))', "req/s"),
    Chart("server_errors", "5xx share",
          'sum(rate(gateway_requests_total{status=~"5.."}[5m])) / sum(rate(gateway_requests_total[5m]))', "ratio"),
    Chart("latency_p50", "p50 latency", 'histogram_quantile(0.5, sum by (le) '
          '(rate(gateway_request_seconds_bucket{route=~"/v1/.*"}[5m])))', "s"),
    Chart("latency_p95", "p95 latency", 'histogram_quantile(0.95, sum by (le) '
          '(rate(gateway_request_seconds_bucket{route=~"/v1/.*"}[5m])))', "s"),
    Chart("ttft_p95", "TTFT p95", "histogram_quantile(0.95, sum by (le, model) "
          "(rate(gateway_time_to_first_token_seconds_bucket[5m])))", "s", combine="max"),
    Chart("tokens_out", "tokens/s out", "sum by (direction) (rate(gateway_tokens_total[5m]))", "tok/s",
          only=(("direction", "out"),)),
    Chart("kv_cache", "KV cache used", "vllm:kv_cache_usage_perc", "ratio", combine="max"),
    Chart("engine_waiting", "engine waiting", "sum by (pool, replica) (vllm:num_requests_waiting)", "requests"),
)


class Series(BaseModel):
    """One key series over the window: a point a step, oldest first; None where Prometheus has no
    sample (nothing scraped yet, no traffic for a ratio or a percentile)."""

    name: str
    label: str
    unit: str = Field(description="req/s, ratio (0 to 1), s, tok/s or requests.")
    start: datetime = Field(description="The time of the first point.")
    step_s: int
    points: list[float | None]


def prometheus_url(monitoring: MonitoringSettings) -> str:
    return f"https://127.0.0.1:{monitoring.prometheus_port}"


def series(monitoring: MonitoringSettings, home: Home, minutes: int = MINUTES, step_s: int = STEP_S,
           now: float | None = None) -> list[Series]:
    """Every key series over the last `minutes`, a point every `step_s`."""
    if minutes < 1 or step_s < 1:
        raise Invalid(f"minutes ({minutes}) and step_s ({step_s}) must be at least 1")
    count = minutes * 60 // step_s + 1
    if count > MAX_POINTS:
        raise Invalid(f"{minutes} minutes a point every {step_s} s is {count} points a series; at most {MAX_POINTS}",
                      hint="take a longer step or a shorter window")
    if not monitoring.enabled:
        raise Conflict("monitoring is off (monitoring.enabled = false): there are no charts to show")
    end = int(time.time() if now is None else now) // step_s * step_s  # on the step: refreshes line up
    return series_at(prometheus_url(monitoring), home, end - (count - 1) * step_s, step_s, count)


def series_at(url: str, home: Home, start: int, step_s: int, count: int) -> list[Series]:
    """Every key series from the Prometheus at `url`: `count` points from `start` (Unix seconds)."""
    found: list[Series] = []
    asked = "its series"
    try:
        # The server is verified before the password goes: a local user on the port gets nothing.
        with httpx.Client(auth=monitoring_auth(home), verify=local_trust(home), timeout=TIMEOUT_S) as client:
            for chart in CHARTS:
                asked = f"the {chart.name} series"
                params = {"query": chart.expression, "start": str(start),
                          "end": str(start + (count - 1) * step_s), "step": str(step_s)}
                matrix = _matrix(client.get(f"{url}/api/v1/query_range", params=params))
                found.append(Series(name=chart.name, label=chart.label, unit=chart.unit,
                                    start=datetime.fromtimestamp(start, UTC), step_s=step_s,
                                    points=_points(chart, matrix, start, step_s, count)))
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError, OverflowError, StateError) as exc:
        raise Unavailable(f"Prometheus at {url} did not answer {asked}: {exc}",
                          hint="`appliance status` shows whether prometheus runs") from exc
    return found


def _matrix(response: httpx.Response) -> list[dict[str, Any]]:
    """A range query's result series; ValueError (or HTTPStatusError) for anything else."""
    try:
        answer = response.json()
    except ValueError:
        response.raise_for_status()  # a refusal (401) without a JSON body says so
        raise
    if not isinstance(answer, dict) or answer.get("status") != "success":
        error = answer.get("error") if isinstance(answer, dict) else None
        raise ValueError(f"HTTP {response.status_code}: {error or 'not a successful answer'}")
    data = answer["data"]
    if data["resultType"] != "matrix":
        raise ValueError(f"a {data['resultType']} where a range query answers a matrix")
    return list(data["result"])


def _points(chart: Chart, matrix: list[dict[str, Any]], start: int, step_s: int, count: int) -> list[float | None]:
    """One point a step: the chart's result series combined; NaN and infinities are no sample."""
    per_step: list[list[float]] = [[] for _ in range(count)]
    for result in matrix:
        labels: Mapping[str, str] = result.get("metric", {})
        if any(labels.get(key) != value for key, value in chart.only):
            continue
        for at, text in result["values"]:
            index = round((float(at) - start) / step_s)
            value = float(text)
            if 0 <= index < count and math.isfinite(value):
                per_step[index].append(value)
    if chart.combine == "max":
        return [max(values) if values else None for values in per_step]
    return [math.fsum(values) if values else None for values in per_step]
