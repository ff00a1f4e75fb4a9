"""The session appliance: the whole appliance (Keycloak, vLLM serving the demo model, the gateway)
started once per test run and shared by every worker's integration tests. The first worker to
ask starts it; the others find its record; the run's main process stops it at the end."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from appliance.home import Home
from tests.support.appliances import Appliance, new_appliance, remove_appliance
from tests.support.shared import locked, shared_dir

RECORD = "session-appliance.json"


@dataclass
class Running:
    appliance: Appliance
    up_output: str
    up_seconds: float


def start_or_join(demo: Path, keycloak: Path, settings: dict[str, str]) -> Running:
    """The run's session appliance: started now if no worker started it yet."""
    record = shared_dir() / RECORD
    with locked("session-start", exclusive=True):
        if not record.exists():
            appliance = new_appliance(demo, keycloak, **settings)
            # Recorded before it starts, so that the end of the run stops even a failed start.
            record.write_text(json.dumps({"root": str(appliance.home.root), "env": appliance.env}))
            started = time.monotonic()
            result = appliance.run("up")
            assert result.returncode == 0, result.stdout + result.stderr
            record.write_text(json.dumps({"root": str(appliance.home.root), "env": appliance.env,
                                          "up_output": result.stdout, "up_seconds": time.monotonic() - started}))
        found = json.loads(record.read_text())
    assert "up_output" in found, f"the session appliance failed to start: see {found['root']}/logs"
    return Running(Appliance(Home(Path(found["root"])), found["env"]), found["up_output"], found["up_seconds"])


def running_again(running: Running) -> None:
    """Starts the session appliance again if its gateway does not answer (a module before stopped it)."""
    with locked("session-start", exclusive=True):
        if not answers(running.appliance):
            result = running.appliance.run("up")
            assert result.returncode == 0, result.stdout + result.stderr


def answers(appliance: Appliance) -> bool:
    """Whether the appliance's gateway answers its health check."""
    try:
        url = f"http://127.0.0.1:{appliance.port('APPLIANCE_GATEWAY__PORT')}/healthz"
        return httpx.get(url, timeout=5).is_success
    except httpx.HTTPError:
        return False


def stop_session_appliance() -> None:
    """Stops and removes the session appliance, if this run started one."""
    record = shared_dir() / RECORD
    if record.exists():
        found = json.loads(record.read_text())
        remove_appliance(Appliance(Home(Path(found["root"])), found["env"]))
