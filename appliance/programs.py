"""What supervisord runs: program specs, contributed by packages through entry points.

`appliance up` asks every `appliance.programs` entry point for its programs, so the core never
imports the packages that build on it. Each entry point is a callable
`(settings, home) -> list[Program]`.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from appliance.home import HOME_ENV, Home

if TYPE_CHECKING:  # `appliance status` reads programs without building the settings' and hosts' schemas
    from appliance.settings import Settings

CONTROL = re.compile(r"[\x00-\x1f\x7f]")
ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
PROGRAMS_GROUP = "appliance.programs"
# On a host that joined a cluster as a worker: only its ranks and the agent reporting them.
WORKER_PROGRAMS_GROUP = "appliance.worker_programs"
# The appliance serves and trains on local files in closed networks: nothing it runs may reach a
# model hub or send usage statistics. supervisord passes these to every program.
OFFLINE_ENVIRONMENT = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                       "HF_HUB_DISABLE_TELEMETRY": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1",
                       "DO_NOT_TRACK": "1"}


class Program(BaseModel):
    """One supervised process and how to tell that it is ready."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(pattern=r"^[a-z][a-z0-9_-]*$",
                      description="Its supervisord program name (engine replicas: vllm-<pool>_<i>).")
    command: list[str] = Field(min_length=1)
    environment: dict[str, str] = Field(default_factory=dict)
    directory: Path | None = None
    port: int | None = Field(None, description="Loopback port it listens on; checked free before start.")
    socket: Path | None = Field(
        None, description="Unix socket it listens on, in a private directory; a stale one is removed before "
        "it starts, and its health_url is asked over it."
    )
    health_url: str | None = Field(None, description="Answers 200 once the program is ready.")
    health_password_secret: str | None = Field(
        None, description="The appliance secret that is the health URL's basic-auth password (user `appliance`).")
    urls: dict[str, str] = Field(default_factory=dict, description="What it serves, for status.")
    model: str | None = Field(None, description="Model name it serves, if any.")
    pool: str | None = Field(None, description="The engine pool it belongs to, if any.")
    gpus: list[int] = Field(default_factory=list, description="GPU indexes it holds (engine pools on GPU hosts).")
    priority: int = Field(100, description="Lower starts first.")
    autostart: bool = Field(
        True, description="supervisord starts it (and restarts it when it exits); False: another program does "
        "(the cluster controller, for the head's ranks of a pool spanning hosts), and `up` does not wait for it."
    )
    startsecs: int = Field(5, ge=0, description="Seconds up before supervisord counts it started.")
    stopwaitsecs: int = Field(30, ge=1, description="Grace period between the stop signal and SIGKILL.")
    stop_signal: Literal["TERM", "INT"] = Field("TERM", description="What asks it to stop (PostgreSQL: INT, "
                                                "its fast shutdown; TERM would wait for every client to leave).")
    start_timeout_s: int = Field(120, gt=0, description="How long `up` waits for health.")
    start_nice: int = Field(0, ge=0, le=19, description="CPU niceness while `up` starts the appliance (what "
                            "the engines do not need yields the cores to them); back to 0 once all are ready.")
    missing: str | None = Field(
        None, description="Why it cannot start (e.g. model not prepared), checked before start."
    )

    @model_validator(mode="after")
    def _one_line_each(self) -> Program:
        """Every value ends up on one line of supervisord's configuration: none may end that line
        (a joined worker's ranks come from its head, so this is checked here, for every program)."""
        for value in [*self.command, *self.environment.values()]:
            if CONTROL.search(value):
                raise ValueError(f"program {self.name}: a control character in {value[:80]!r}")
        for key in self.environment:
            if not ENV_KEY.fullmatch(key):
                raise ValueError(f"program {self.name}: {key[:80]!r} is not an environment variable name")
        return self


def python_module_program(name: str, module: str, home: Home, *, priority: int, start_nice: int = 0,
                          stopwaitsecs: int = 30) -> Program:
    """A background Python process of the appliance (`python -P -m module`, a queue worker or a
    scheduler): no port, no health URL; `up` counts it started once it stays up 2 s."""
    return Program(name=name, command=[sys.executable, "-P", "-m", module], environment={HOME_ENV: str(home.root)},
                   priority=priority, startsecs=2, stopwaitsecs=stopwaitsecs, start_nice=start_nice)


ProgramSource = Callable[["Settings", Home], list[Program]]
# Runs after every program is ready (e.g. Keycloak realm provisioning); returns lines to print.
Provisioner = Callable[["Settings", Home], list[str]]
PROVISIONERS_GROUP = "appliance.provisioners"


def discover_programs(settings: Settings, home: Home) -> list[Program]:
    """All programs every installed package contributes, in start order (a worker's own only)."""
    from appliance.hosts import membership_file

    programs: list[Program] = []
    group = WORKER_PROGRAMS_GROUP if membership_file(home).exists() else PROGRAMS_GROUP
    for ep in sorted(entry_points(group=group), key=lambda ep: ep.name):
        source: ProgramSource = ep.load()
        programs.extend(source(settings, home))
    return sorted(programs, key=lambda p: (p.priority, p.name))


def run_provisioners(settings: Settings, home: Home) -> list[str]:
    """Run every `appliance.provisioners` entry point (none on a worker); collect what they want printed."""
    from appliance.hosts import membership_file

    lines: list[str] = []
    if membership_file(home).exists():
        return lines
    for ep in sorted(entry_points(group=PROVISIONERS_GROUP), key=lambda ep: ep.name):
        provisioner: Provisioner = ep.load()
        lines.extend(provisioner(settings, home))
    return lines
