"""The supervised programs serve contributes: one vLLM server per pool, and the gateway."""

from __future__ import annotations

import sys
from pathlib import Path

from appliance.home import HOME_ENV, Home
from appliance.local_gateway import gateway_url
from appliance.programs import Program
from appliance.settings import Settings
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


def serve_programs(settings: Settings, home: Home) -> list[Program]:
    """The `appliance.programs` entry point: engines first, then the gateway in front of them."""
    return [*engine_programs(settings, home), gateway_program(settings, home)]
