"""An appliance for a test or a bench: a state directory of its own and the `appliance` command
run for real against it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path

from appliance.home import HOME_ENV, Home
from installer.keycloak_dist import install_dir
from tests.support.ports import free_port

APPLIANCE = str(Path(sys.executable).with_name("appliance"))
# Settings that keep a test appliance from needing Keycloak at all.
NO_KEYCLOAK = {"APPLIANCE_KEYCLOAK__MODE": "external", "APPLIANCE_KEYCLOAK__URL": "https://127.0.0.1:9",
               "APPLIANCE_KEYCLOAK__GATEWAY_CLIENT_SECRET": "unused"}


@dataclass
class Appliance:
    """One state directory and the CLI pointed at it."""

    home: Home
    env: dict[str, str] = field(default_factory=dict)

    def run(self, *args: str, timeout: float = 900, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([APPLIANCE, *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout, check=False, input=stdin)

    def port(self, name: str) -> int:
        return int(self.env[name])

    def login_cache(self) -> Path:
        """The cached login of its CLI (one realm: one file)."""
        [cache] = (Path(self.env["XDG_CONFIG_HOME"]) / "appliance" / "logins").glob("*.json")
        return cache


def make_appliance(demo: Path | None, keycloak: Path | None = None,
                   **overrides: str) -> Generator[Appliance, None, None]:
    """A fresh appliance (new_appliance) for as long as the generator lives, then removed."""
    appliance = new_appliance(demo, keycloak, **overrides)
    try:
        yield appliance
    finally:
        remove_appliance(appliance)


def new_appliance(demo: Path | None, keycloak: Path | None = None, **overrides: str) -> Appliance:
    """A fresh state directory on free ports; with the demo model and a private copy of Keycloak
    (its database lives in its directory) if given, else configured not to need Keycloak."""
    # Short path: supervisord's unix socket lives inside it (107-byte limit).
    root = Path(tempfile.mkdtemp(prefix="ap-", dir="/tmp"))
    root.chmod(0o711)  # as /var/lib is: a service user (PostgreSQL's) may pass through to its own directory
    home = Home(root / "h").ensure()
    if demo is not None:
        home.demo_model.symlink_to(demo, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    env.update({HOME_ENV: str(home.root), "COLUMNS": "200", "XDG_CONFIG_HOME": str(root / "config"),
                "APPLIANCE_GATEWAY__PORT": str(free_port()),
                "APPLIANCE_MONITORING__PROMETHEUS_PORT": str(free_port()),
                "APPLIANCE_MONITORING__ALERTMANAGER_PORT": str(free_port())})
    if keycloak is not None:
        target = install_dir(home)
        shutil.copytree(keycloak, target, symlinks=True, ignore=shutil.ignore_patterns("h2", "tmp"))
        env.update({"APPLIANCE_KEYCLOAK__PORT": str(free_port()),
                    "APPLIANCE_KEYCLOAK__MANAGEMENT_PORT": str(free_port()),
                    "APPLIANCE_KEYCLOAK__POSTGRES_PORT": str(free_port())})
    else:
        env.update(NO_KEYCLOAK)
    env.update(overrides)
    return Appliance(home=home, env=env)


def remove_appliance(appliance: Appliance) -> None:
    """Everything it runs stopped, and its state directory removed."""
    appliance.run("down", timeout=300)
    shutil.rmtree(appliance.home.root.parent, ignore_errors=True)
