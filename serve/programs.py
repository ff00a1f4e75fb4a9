"""The supervised programs serve contributes: one vLLM server per pool, and the gateway."""

from __future__ import annotations

import sys

from appliance.home import HOME_ENV, Home
from appliance.programs import Program
from appliance.settings import Settings
from serve.engine import engine_programs


def gateway_program(settings: Settings, home: Home) -> Program:
    gateway = settings.gateway
    host = "127.0.0.1" if gateway.bind in ("0.0.0.0", "::") else gateway.bind
    base = f"http://{host}:{gateway.port}"
    return Program(
        name="gateway",
        # -P: never import from the working directory, the state dir, whose audit/ folder would
        # otherwise shadow the audit package. serve.listener reads the settings itself.
        command=[sys.executable, "-P", "-m", "serve.listener"],
        environment={HOME_ENV: str(home.root)},
        port=gateway.port,
        health_url=f"{base}/healthz",
        urls={"openai": f"{base}/v1", "admin": f"{base}/admin", "metrics": f"{base}/metrics",
              "issuer": settings.keycloak.issuer},
        priority=90, startsecs=2, stopwaitsecs=10, start_timeout_s=60,
    )


def serve_programs(settings: Settings, home: Home) -> list[Program]:
    """The `appliance.programs` entry point: engines first, then the gateway in front of them."""
    return [*engine_programs(settings, home), gateway_program(settings, home)]
