"""The supervised programs serve contributes: one vLLM server per pool, and the gateway."""

from __future__ import annotations

import sys
from pathlib import Path

from appliance.home import HOME_ENV, Home
from appliance.programs import Program
from appliance.settings import Settings
from serve.engine import engine_programs

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def gateway_program(settings: Settings, home: Home) -> Program:
    gateway = settings.gateway
    host = "127.0.0.1" if gateway.bind in ("0.0.0.0", "::") else gateway.bind
    base = f"http://{host}:{gateway.port}"
    return Program(
        name="gateway",
        # -P and --app-dir: never import from the working directory (uvicorn's default app dir),
        # the state dir, whose audit/ folder would otherwise shadow the audit package.
        command=[sys.executable, "-P", "-m", "uvicorn", "serve.gateway:app_from_env", "--factory",
                 "--app-dir", str(PROJECT_ROOT),
                 "--host", gateway.bind, "--port", str(gateway.port),
                 "--no-access-log", "--log-level", "warning", "--timeout-graceful-shutdown", "5"],
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
