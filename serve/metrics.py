"""The gateway's Prometheus metrics, in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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
        self.auth_failures = Counter("gateway_auth_failures_total", "Rejected tokens by reason.",
                                     ["reason"], registry=self.registry)
        self.jwks_fetches = Counter("gateway_jwks_fetches_total", "Fetches of the realm's signing keys.",
                                    registry=self.registry)
        self.archive_failures = Counter("gateway_audit_archive_failures_total",
                                        "Failed copies of the audit log to the artifact store.",
                                        registry=self.registry)
        self.archived_at = Gauge("gateway_audit_archived_timestamp_seconds",
                                 "When the audit log was last archived (Unix time).",
                                 registry=self.registry)
