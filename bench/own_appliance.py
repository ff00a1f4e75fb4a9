"""An appliance of a bench's own: a fresh home beside the default one (its demo model linked, its
embedded Keycloak copied, so nothing is downloaded), run with the CLI on ports of the bench's
choosing and taken down, its home removed, when the bench is done."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from appliance.home import HOME_ENV, Home
from installer.keycloak_dist import install_dir
from tests.support.ports import free_port

APPLIANCE = str(Path(sys.executable).with_name("appliance"))


def cli(env: dict[str, str], *args: str, stdin: str | None = None, timeout: float = 3600) -> str:
    """`appliance ARGS` with `env`; its standard output, or the bench stops saying what failed."""
    done = subprocess.run([APPLIANCE, *args], env=env, capture_output=True, text=True, input=stdin, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"appliance {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


@contextmanager
def own_appliance(prefix: str, settings: dict[str, str], *, settings_file: str | None = None
                  ) -> Iterator[tuple[Home, dict[str, str]]]:
    """A new home and the environment that names it with `settings` (APPLIANCE_* overrides: the
    ports at least; the caller's own APPLIANCE_* are left out); `settings_file` is written as the
    home's settings. The caller starts it (`appliance up`); it is taken down and removed after."""
    default = Home.from_env()
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    root.chmod(0o711)  # PostgreSQL's user passes through to its own directory
    home = Home(root / "h").ensure()
    home.demo_model.symlink_to(default.demo_model, target_is_directory=True)
    shutil.copytree(install_dir(default), install_dir(home), symlinks=True, ignore=shutil.ignore_patterns("h2", "tmp"))
    if settings_file is not None:
        home.settings_file.write_text(settings_file)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}, HOME_ENV: str(home.root),
           "APPLIANCE_KEYCLOAK__POSTGRES_PORT": str(free_port()),
           "APPLIANCE_MONITORING__PROMETHEUS_PORT": str(free_port()),
           "APPLIANCE_MONITORING__ALERTMANAGER_PORT": str(free_port()), **settings}
    try:
        yield home, env
    finally:
        subprocess.run([APPLIANCE, "down"], env=env, capture_output=True, timeout=600)
        shutil.rmtree(root, ignore_errors=True)
