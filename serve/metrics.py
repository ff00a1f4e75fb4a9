"""The gateway's Prometheus metrics, in a registry of its own, and the state it reads at each scrape."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

from cryptography import x509
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from appliance.home import Home
from appliance.tls import tls_dir
from audit import AuditWriter

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    """Requests by route/status/role, latency, time to first token, tokens, errors, auth failures."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("gateway_requests_total", "Requests answered.",
                                ["route", "status", "role"], registry=self.registry)
        self.latency = Histogram("gateway_request_seconds", "Time to the complete response.",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.ttft = Histogram("gateway_time_to_first_token_seconds", "Time to the first streamed token.",
                              ["model"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tokens = Counter("gateway_tokens_total", "Tokens in (prompt) and out (completion).",
                              ["direction", "model"], registry=self.registry)
        self.upstream_errors = Counter("gateway_upstream_errors_total", "Engine errors by kind.",
                                       ["pool", "reason"], registry=self.registry)
        self.replica_in_flight = Gauge("gateway_replica_in_flight", "Requests in flight on each engine replica.",
                                       ["pool", "replica"], registry=self.registry)
        self.replica_ready = Gauge("gateway_replica_ready", "Whether each engine replica is taking requests (1) "
                                   "or set aside until its health check passes (0).", ["pool", "replica"],
                                   registry=self.registry)
        self.route_choices = Counter("gateway_route_choices_total", "Requests sent to each replica, by why it was "
                                     "chosen (affinity, least_loaded, round_robin, failover).",
                                     ["pool", "replica", "reason"], registry=self.registry)
        self.tier_requests = Counter("gateway_tier_requests_total", "Requests routed to each tier of a model, by "
                                     "how the tier was chosen (named, policy, adapter).", ["model", "tier", "how"],
                                     registry=self.registry)
        self.cache = Counter("gateway_cache_requests_total", "Cacheable requests by outcome (hit, miss, bypass).",
                             ["outcome"], registry=self.registry)
        self.cache_entries = Gauge("gateway_cache_entries", "Answers held by the response cache.",
                                   registry=self.registry)
        self.cache_bytes = Gauge("gateway_cache_bytes", "Bytes of answers held by the response cache.",
                                 registry=self.registry)
        self.auth_failures = Counter("gateway_auth_failures_total", "Rejected tokens by reason.",
                                     ["reason"], registry=self.registry)
        self.slow_connections = Counter("gateway_slow_connections_closed_total", "Connections closed for sending "
                                        "their headers or body too slowly, or evicted past the connection cap.",
                                        ["reason"], registry=self.registry)
        self.jwks_fetches = Counter("gateway_jwks_fetches_total", "Fetches of the realm's signing keys.",
                                    registry=self.registry)
        self.archive_failures = Counter("gateway_audit_archive_failures_total",
                                        "Failed copies of the audit log to the artifact store.",
                                        registry=self.registry)
        self.archived_at = Gauge("gateway_audit_archived_timestamp_seconds",
                                 "When the audit log was last archived (Unix time).",
                                 registry=self.registry)


class StateCollector(Collector):
    """Read at each scrape: whether the audit log takes records and how long its last flush took,
    the state directory's disk, and when each certificate the appliance serves runs out."""

    def __init__(self, home: Home, writer: AuditWriter, organisation_certificate: str | None) -> None:
        self.home, self.writer = home, writer
        self.organisation_certificate = Path(organisation_certificate) if organisation_certificate else None

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("gateway_audit_writable", "Whether the audit log takes records (0: requests "
                                "are refused until it does).", value=float(self.writer.failure is None))
        yield GaugeMetricFamily("gateway_audit_flush_seconds", "How long the audit writer's latest batch took "
                                "to chain, write and flush.", value=self.writer.last_flush_s)
        free = GaugeMetricFamily("appliance_disk_free_bytes", "Free bytes on a volume the appliance writes.",
                                 labels=["volume"])
        size = GaugeMetricFamily("appliance_disk_size_bytes", "Size of a volume the appliance writes.",
                                 labels=["volume"])
        with contextlib.suppress(OSError):
            usage = shutil.disk_usage(self.home.root)
            free.add_metric(["state"], usage.free)
            size.add_metric(["state"], usage.total)
        yield free
        yield size
        expiry = GaugeMetricFamily("appliance_certificate_expiry_timestamp_seconds", "When a certificate the "
                                   "appliance serves or trusts ends (Unix time).", labels=["certificate"])
        for name, path in self._certificates():
            with contextlib.suppress(OSError, ValueError):
                ends = x509.load_pem_x509_certificate(path.read_bytes()).not_valid_after_utc
                expiry.add_metric([name], ends.timestamp())
        yield expiry

    def _certificates(self) -> Iterator[tuple[str, Path]]:
        for path in sorted(tls_dir(self.home).glob("*.pem")):
            yield path.stem, path
        if self.organisation_certificate is not None:
            yield "gateway-organisation", self.organisation_certificate
