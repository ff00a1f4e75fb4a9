"""The gateway's Prometheus metrics, in a registry of its own, and the state it reads at each scrape."""

from __future__ import annotations

import contextlib
import logging
import math
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

from cryptography import x509
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from appliance import heals
from appliance.errors import ApplianceError, SupervisorError
from appliance.home import Home
from appliance.hosts import cluster_state_file, cluster_state_written
from appliance.lifecycle import started_programs
from appliance.queue import Depth
from appliance.rl import executions
from appliance.supervisor import ProcessState, Supervisor
from appliance.tls import tls_dir
from appliance.usage import SLOWDOWNS, gpu_usage
from appliance.work_queues import WORK_QUEUES, WorkQueue
from audit import AuditWriter

log = logging.getLogger(__name__)
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
        self.adapter_requests = Counter("gateway_adapter_requests_total", "Answers of each adapter version from the "
                                        "engine, by status (canary analysis compares versions on them).",
                                        ["adapter", "version", "status"], registry=self.registry)
        self.adapter_feedback = Counter("gateway_adapter_feedback_total", "Clients' outcome reports on adapter "
                                        "answers (success, failure, none), by version.",
                                        ["adapter", "version", "outcome"], registry=self.registry)
        self.canary_decisions = Counter("gateway_canary_decisions_total", "Canaries promoted or aborted by their "
                                        "analysis.", ["decision"], registry=self.registry)
        self.tool_calls = Counter("gateway_tool_calls_total", "Tool calls the models returned, by outcome: passed "
                                  "on, or refused for not matching the request's tools (never passed on as calls).",
                                  ["model", "outcome"], registry=self.registry)
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
    """Read at each scrape: whether the audit log takes records, how long its last flush took, its
    failed writes and when it last took records, the state directory's disk, and when each
    certificate the appliance serves runs out."""

    def __init__(self, home: Home, writer: AuditWriter, organisation_certificate: str | None) -> None:
        self.home, self.writer = home, writer
        self.organisation_certificate = Path(organisation_certificate) if organisation_certificate else None

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("gateway_audit_writable", "Whether the audit log takes records (0: requests "
                                "are refused until it does).", value=float(self.writer.failure is None))
        yield GaugeMetricFamily("gateway_audit_flush_seconds", "How long the audit writer's latest batch took "
                                "to chain, write and flush.", value=self.writer.last_flush_s)
        # The writer lets a write try again a moment after a failure, so `writable` flaps while the
        # log stays unwritable; these two hold what an alert needs.
        yield CounterMetricFamily("gateway_audit_write_failures", "Writes to the audit log (a batch of records "
                                  "or a checkpoint) that failed.", value=self.writer.write_failures)
        yield GaugeMetricFamily("gateway_audit_last_write_timestamp_seconds", "When the audit log last took "
                                "records (Unix time; the gateway's start until it takes one).",
                                value=self.writer.last_write_at)
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


class ClusterCollector(Collector):
    """Read at each scrape: each pool spanning hosts as its controller last wrote it
    (appliance.hosts): whether it serves, and each worker host's rank: whether it runs and how long
    since its last heartbeat (the age the controller wrote, plus the time since it wrote it, so a
    controller that stopped writing does not freeze the age). A host never heard from has no age.
    Only the pools the settings plan across hosts are read (a file left by an earlier plan is not)."""

    def __init__(self, home: Home, pools: list[str]) -> None:
        self.home, self.pools = home, pools

    def collect(self) -> Iterator[Metric]:
        ready = GaugeMetricFamily("appliance_cluster_pool_ready", "Whether a pool spanning hosts serves.",
                                  labels=["pool"])
        running = GaugeMetricFamily("appliance_cluster_rank_running", "Whether a worker host's rank of a pool "
                                    "runs, as it last reported.", labels=["pool", "host"])
        age = GaugeMetricFamily("appliance_cluster_heartbeat_age_seconds", "Since a worker host's last heartbeat "
                                "for a pool.", labels=["pool", "host"])
        for pool in self.pools:
            found = cluster_state_written(cluster_state_file(self.home, pool))
            if found is None:
                continue
            state, written_at = found
            written_s_ago = max(0.0, time.time() - written_at)
            ready.add_metric([state.pool], float(state.ready))
            for rank in state.ranks[1:]:  # the first is the head's own
                running.add_metric([state.pool, rank.host], float(rank.running))
                if rank.seen_s_ago is not None:
                    age.add_metric([state.pool, rank.host], rank.seen_s_ago + written_s_ago)
        yield from (ready, running, age)


class Reused(Collector):
    """`collector` read at most once every `reuse_s`, by one scrape at a time: a flood of scrapes
    costs one read of the databases or of NVML a period."""

    def __init__(self, collector: Collector, reuse_s: float = 2.0) -> None:
        self.collector, self.reuse_s = collector, reuse_s
        self._lock = threading.Lock()
        self._families: list[Metric] = []
        self._at = -math.inf

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            if time.monotonic() - self._at >= self.reuse_s:
                self._families, self._at = list(self.collector.collect()), time.monotonic()
            return iter(self._families)


class QueueCollector(Collector):
    """Read at each scrape: each work queue's waiting and held items and how long the oldest
    waiting one has waited. A queue whose database cannot be read has no series that scrape
    (and appliance_queue_readable 0): no number is made up."""

    def __init__(self, home: Home) -> None:
        self.home = home

    def collect(self) -> Iterator[Metric]:
        readable = GaugeMetricFamily("appliance_queue_readable", "Whether the queue's database could be read.",
                                     labels=["queue"])
        waiting = GaugeMetricFamily("appliance_queue_waiting", "Items waiting for a worker.", labels=["queue"])
        held = GaugeMetricFamily("appliance_queue_held", "Items a worker holds (running).", labels=["queue"])
        oldest = GaugeMetricFamily("appliance_queue_oldest_waiting_seconds", "How long the oldest waiting item "
                                   "has waited (0: none waits).", labels=["queue"])
        claimed = GaugeMetricFamily("appliance_queue_recent_claims", "Items first claimed in the last hour.",
                                    labels=["queue"])
        waited = GaugeMetricFamily("appliance_queue_wait_seconds", "How long the items first claimed in the last "
                                   "hour had waited, by quantile (1: the longest; no series: none claimed).",
                                   labels=["queue", "quantile"])
        readers: list[tuple[str, Callable[[], Depth]]] = [(work.name, partial(_depth, work, self.home))
                                                           for work in WORK_QUEUES]
        readers.append(("rl_executions", partial(executions.depth, self.home)))  # one queue per running run
        for name, read in readers:
            try:
                depth = read()
            except (sqlite3.Error, ApplianceError, OSError) as exc:
                log.warning("queue %s not readable for metrics: %s", name, exc)
                readable.add_metric([name], 0)
                continue
            readable.add_metric([name], 1)
            waiting.add_metric([name], depth.waiting)
            held.add_metric([name], depth.held)
            oldest.add_metric([name], depth.oldest_waiting_s or 0.0)
            claimed.add_metric([name], len(depth.recent_waits_s))
            for quantile, value in wait_quantiles(depth.recent_waits_s).items():
                waited.add_metric([name, quantile], value)
        yield from (readable, waiting, held, oldest, claimed, waited)


def wait_quantiles(waits: tuple[float, ...]) -> dict[str, float]:
    """The median, 95th percentile and longest of `waits` (nearest rank); none for no waits."""
    ordered = sorted(waits)
    if not ordered:
        return {}
    return {label: ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]
            for label, q in (("0.5", 0.5), ("0.95", 0.95), ("1", 1.0))}


class ProgramCollector(Collector):
    """Read at each scrape: the watchdog's restarts of each engine replica, by reason
    (appliance.heals), and of each program whether it runs, whether supervisord has given up on it
    (FATAL: it exited during each of its starts) and how often supervisord started it again (its
    log's count: a crash loop shows even when each crash is over between two scrapes). With
    supervisord not answering, appliance_supervisor_up is 0 and no program has a state series."""

    def __init__(self, home: Home) -> None:
        self.home, self.supervisor = home, Supervisor(home)

    def collect(self) -> Iterator[Metric]:
        restarts = CounterMetricFamily("appliance_watchdog_restarts", "Engine replicas restarted by the watchdog, "
                                       "by reason (unhealthy, no_progress, gave_up).",
                                       labels=["program", "pool", "reason"])
        healed = heals.load(self.home)
        # Every engine replica has its series from the start, at 0, so that its first restart is an increase.
        engines = {program.name: program.pool for program in started_programs(self.home)
                   if program.pool and program.socket}
        for program in sorted(engines.keys() | healed.restarts.keys()):
            pool = engines.get(program) or healed.pools.get(program, "")
            for reason in heals.Reason:
                restarts.add_metric([program, pool, reason], healed.restarts.get(program, {}).get(reason, 0))
        yield restarts
        fatal = GaugeMetricFamily("appliance_program_fatal", "Whether supervisord has given up on the program "
                                  "(FATAL; the watchdog starts engines again, nothing else does).",
                                  labels=["program", "pool"])
        running = GaugeMetricFamily("appliance_program_running", "Whether the program runs (supervisord's "
                                    "RUNNING: started, and up past its start time).", labels=["program", "pool"])
        started_again = CounterMetricFamily("appliance_program_restarts", "How often supervisord started the "
                                            "program again after its first start (crashes, the watchdog's "
                                            "restarts, an operator's).", labels=["program", "pool"])
        try:
            processes = self.supervisor.processes()
        except SupervisorError as exc:
            log.warning("supervisord not readable for metrics: %s", exc)
            processes = None
        yield GaugeMetricFamily("appliance_supervisor_up", "Whether supervisord answered.", value=processes is not None)
        pools = {program.name: program.pool or "" for program in started_programs(self.home)}
        try:
            restarted = self.supervisor.restarts() if processes is not None else {}
        except OSError as exc:  # no log yet: no count is made up
            log.warning("supervisord's log not readable for metrics: %s", exc)
            restarted = {}
        for info in processes or []:
            at = [info.name, pools.get(info.name, "")]
            fatal.add_metric(at, int(info.state == ProcessState.FATAL))
            running.add_metric(at, int(info.state == ProcessState.RUNNING))
            if info.name in restarted:
                started_again.add_metric(at, restarted[info.name])
        yield from (fatal, running, started_again)


def _depth(work: WorkQueue, home: Home) -> Depth:
    with work.connect(home) as db:
        return work.queue.depth(db)


class GpuCollector(Collector):
    """Read at each scrape: each GPU's figures from NVML (appliance.usage), labelled with its index
    and the pool whose engine holds it. `appliance_gpu_nvml_up` 0 (and no GPU series) where NVML
    cannot be read; a figure a GPU does not report has no series: no number is made up."""

    def __init__(self, home: Home, nvml_library: str | None) -> None:
        self.home, self.nvml_library = home, nvml_library

    def collect(self) -> Iterator[Metric]:
        gpus, error = gpu_usage(self.nvml_library)
        yield GaugeMetricFamily("appliance_gpu_nvml_up", "Whether NVML answered (0: no GPU figures; the "
                                "gateway's log says why).", value=float(error is None))
        if error is not None:
            log.debug("no GPU metrics: %s", error)
        holders = {gpu: program.pool for program in started_programs(self.home) if program.pool
                   for gpu in program.gpus}
        labels = ["gpu", "pool"]
        info = GaugeMetricFamily("appliance_gpu_info", "Each GPU's model and UUID (value 1).",
                                 labels=[*labels, "name", "uuid"])
        families = {
            "utilization": GaugeMetricFamily("appliance_gpu_utilization_ratio", "Share of the last sample "
                                             "period a kernel ran.", labels=labels),
            "memory_used": GaugeMetricFamily("appliance_gpu_memory_used_bytes", "GPU memory in use.", labels=labels),
            "memory_total": GaugeMetricFamily("appliance_gpu_memory_total_bytes", "GPU memory.", labels=labels),
            "temperature": GaugeMetricFamily("appliance_gpu_temperature_celsius", "GPU core temperature.",
                                             labels=labels),
            "power": GaugeMetricFamily("appliance_gpu_power_watts", "Power drawn by the board.", labels=labels),
            "retired": GaugeMetricFamily("appliance_gpu_retired_pages", "Memory pages retired for ECC errors.",
                                         labels=labels),
            "remapped": GaugeMetricFamily("appliance_gpu_remapped_rows_uncorrectable", "Memory rows remapped for "
                                          "uncorrectable errors.", labels=labels),
            "remap_failed": GaugeMetricFamily("appliance_gpu_row_remap_failed", "Whether a row remapping failed "
                                              "(the board needs service).", labels=labels),
        }
        ecc = CounterMetricFamily("appliance_gpu_ecc_errors", "ECC errors since the board was made.",
                                  labels=[*labels, "kind"])
        slowdown = GaugeMetricFamily("appliance_gpu_slowdown", "Whether the GPU's clocks are held down, by "
                                     "reason (power cap, thermal, hardware slowdown, power brake).",
                                     labels=[*labels, "reason"])
        for gpu in gpus:
            at = [str(gpu.index), holders.get(gpu.index, "")]
            info.add_metric([*at, gpu.name, gpu.uuid or ""], 1)
            figures = {"utilization": None if gpu.utilization_percent is None else gpu.utilization_percent / 100,
                       "memory_used": gpu.memory_used_bytes, "memory_total": gpu.memory_total_bytes,
                       "temperature": gpu.temperature_c, "power": gpu.power_watts, "retired": gpu.retired_pages,
                       "remapped": gpu.remapped_rows_uncorrectable,
                       "remap_failed": None if gpu.row_remap_failed is None else int(gpu.row_remap_failed)}
            for key, value in figures.items():
                if value is not None:
                    families[key].add_metric(at, value)
            for kind, count in (("corrected", gpu.ecc_corrected), ("uncorrected", gpu.ecc_uncorrected)):
                if count is not None:
                    ecc.add_metric([*at, kind], count)
            if gpu.slowdowns is not None:
                for reason in SLOWDOWNS.values():
                    slowdown.add_metric([*at, reason], int(reason in gpu.slowdowns))
        yield from (info, *families.values(), ecc, slowdown)
