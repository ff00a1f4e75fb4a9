"""The supervised programs serve contributes: one vLLM server per pool, the gateway, the batch
worker, the engines' watchdog and, where settings name a cluster address, the cluster listener.

Only their specs, so that `appliance up` starts supervisord without importing the gateway.
"""

from __future__ import annotations

import sys
from pathlib import Path

from appliance.batches import BATCH_WORKER_SECRET
from appliance.engine_launch import python
from appliance.home import HOME_ENV, Home
from appliance.local_gateway import gateway_url
from appliance.programs import Program, python_module_program
from appliance.secrets import secret
from appliance.settings import Settings
from appliance.tls import ensure_server_certificate
from serve.engine import engine_programs


def gateway_program(settings: Settings, home: Home) -> Program:
    gateway = settings.gateway
    base = gateway_url(settings)
    return Program(
        name="gateway",
        # -P: never import from the working directory, the state dir, whose audit/ folder would
        # otherwise shadow the audit package. serve.listener reads the settings itself.
        command=[sys.executable, "-P", "-m", "serve.listener"],
        environment={HOME_ENV: str(home.root)},
        port=gateway.port,
        health_url=f"{base}/healthz",
        urls={"openai": f"{base}/v1", "admin": f"{base}/admin", "metrics": f"{base}/metrics",
              "issuer": settings.keycloak.issuer,
              **({"public": f"{gateway.public_url}/v1"} if gateway.public_url else {})},
        priority=90, startsecs=2, stopwaitsecs=10, start_timeout_s=60, missing=_certificate_problem(settings),
    )


def _certificate_problem(settings: Settings) -> str | None:
    """Why the gateway cannot serve HTTPS with the organisation's certificate, if it is set."""
    gateway = settings.gateway
    if not gateway.https or gateway.certificate is None or gateway.private_key is None:
        return None
    from appliance.tls import organisation_certificate_problem  # cryptography: only for this case

    problem = organisation_certificate_problem(Path(gateway.certificate), Path(gateway.private_key))
    return f"gateway.certificate: {problem}" if problem else None


def batch_worker_program(settings: Settings, home: Home) -> Program:
    """The batch worker, after the gateway it sends its requests through; it serves no request of
    its own, so it yields the cores while `up` runs."""
    secret(home, BATCH_WORKER_SECRET)  # made once, at `up`: the gateway and the worker read it
    return python_module_program("batch-worker", "serve.batch_worker", home, priority=96,
                                 start_nice=settings.engine.yield_nice)


def watchdog_programs(settings: Settings, home: Home, engines: list[Program]) -> list[Program]:
    """The watchdog (serve.watchdog), where there are engines on this host for it to watch."""
    if not settings.watchdog.enabled or not any(engine.autostart for engine in engines):
        return []
    return [python_module_program("watchdog", "serve.watchdog", home, priority=97,
                                  start_nice=settings.engine.yield_nice)]


def cluster_programs(settings: Settings, home: Home) -> list[Program]:
    """The `cluster` program, where settings name a cluster address."""
    cluster = settings.cluster
    if cluster.bind is None:
        return []
    # Made now, so that `up` checks its health against the CA (the program reuses it).
    ensure_server_certificate(home, "cluster", (str(cluster.bind),))
    return [Program(
        name="cluster",
        command=[python(), "-P", "-m", "serve.cluster"],
        environment={HOME_ENV: str(home.root)},
        health_url=f"https://{_url_host(str(cluster.bind))}:{cluster.port}/cluster/healthz",
        urls={"cluster": f"https://{_url_host(str(cluster.bind))}:{cluster.port}"},
        priority=80, startsecs=2, stopwaitsecs=10, start_timeout_s=60,
    )]


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def serve_programs(settings: Settings, home: Home) -> list[Program]:
    """The `appliance.programs` entry point: engines first, the cluster listener, the gateway in
    front of them, then the batch worker and the engines' watchdog."""
    engines = engine_programs(settings, home)
    return [*engines, *cluster_programs(settings, home), gateway_program(settings, home),
            batch_worker_program(settings, home), *watchdog_programs(settings, home, engines)]
