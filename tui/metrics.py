"""Gateway figures for the dashboard from two scrapes of its /metrics: requests/s, latency
percentiles (interpolated within histogram buckets, as Prometheus' histogram_quantile does),
tokens/s and errors/s over the interval between them. Only /v1 traffic counts: the TUI's own
/admin and /metrics calls would otherwise show up as load."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Scrape:
    at: float  # monotonic seconds
    requests: float = 0.0
    errors: float = 0.0  # 5xx answers
    refused: float = 0.0  # 4xx answers (auth, limits, bad requests)
    tokens_in: float = 0.0
    tokens_out: float = 0.0
    buckets: dict[float, float] = field(default_factory=dict)  # latency: upper bound -> cumulative count


@dataclass(frozen=True)
class Rates:
    requests_per_s: float
    errors_per_s: float
    refused_per_s: float
    tokens_in_per_s: float
    tokens_out_per_s: float
    p50_s: float | None  # None: no request finished in the interval
    p95_s: float | None
    p99_s: float | None


def parse(text: str, at: float) -> Scrape:
    requests = errors = refused = tokens_in = tokens_out = 0.0
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "gateway_requests_total" and labels.get("route", "").startswith("/v1/"):
                requests += sample.value
                status = int(labels.get("status", "0"))
                errors += sample.value if status >= 500 else 0
                refused += sample.value if 400 <= status < 500 else 0
            elif sample.name == "gateway_tokens_total":
                if labels.get("direction") == "in":
                    tokens_in += sample.value
                else:
                    tokens_out += sample.value
            elif sample.name == "gateway_request_seconds_bucket" and labels.get("route", "").startswith("/v1/"):
                bound = float(labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + sample.value
    return Scrape(at, requests, errors, refused, tokens_in, tokens_out, buckets)


def rates(before: Scrape, after: Scrape) -> Rates:
    seconds = max(after.at - before.at, 1e-9)
    delta = {bound: after.buckets.get(bound, 0.0) - before.buckets.get(bound, 0.0) for bound in after.buckets}

    def per_s(name: str) -> float:
        change: float = getattr(after, name) - getattr(before, name)
        return max(0.0, change) / seconds

    return Rates(per_s("requests"), per_s("errors"), per_s("refused"), per_s("tokens_in"), per_s("tokens_out"),
                 quantile(0.5, delta), quantile(0.95, delta), quantile(0.99, delta))


def quantile(q: float, cumulative: dict[float, float]) -> float | None:
    """The q-quantile of a histogram given as cumulative counts per upper bound."""
    bounds = sorted(cumulative)
    if not bounds or cumulative[bounds[-1]] <= 0:
        return None
    rank = q * cumulative[bounds[-1]]
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = cumulative[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # beyond the largest finite bucket: its bound is all we know
            share = (rank - lower_count) / (count - lower_count) if count > lower_count else 1.0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound
