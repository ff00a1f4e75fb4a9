"""Moving an embedded Keycloak from its dev-file (H2) database to PostgreSQL, once, at `up`:
Keycloak's own export of every realm (users with their password hashes, roles, clients with their
secrets, the master realm's administrator) from H2, then its import into the new PostgreSQL
database. Keycloak must be stopped (H2 holds its file). The H2 files are kept, renamed, until an
operator removes them; a failed import removes the half-filled cluster, so the next `up` starts over.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from appliance.errors import Conflict
from appliance.home import Home
from appliance.settings import KeycloakSettings
from installer import postgres
from installer.keycloak_dist import BUILD_OPTIONS, POSTGRES_BUILD_OPTIONS, KeycloakError, build, data_dir, install_dir

HEAP = "-Xms64m -Xmx768m"


def h2_dir(home: Home) -> Path:
    return data_dir(home) / "h2"


def needs_migration(home: Home) -> bool:
    """Whether this appliance's users are still in H2 while PostgreSQL holds none of them."""
    h2 = h2_dir(home)
    return h2.is_dir() and any(h2.glob("*.mv.db")) and not postgres.postgres_made(home)


def h2_open(home: Home) -> bool:
    """Whether a Keycloak has the H2 database open (it locks the file while it runs)."""
    for database in h2_dir(home).glob("*.mv.db"):
        with database.open("rb+") as file:
            try:
                fcntl.lockf(file, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                return True
    return False


def _kc(home: Home, java: Path, *args: str, password: str | None = None) -> None:
    environment = {**os.environ, "JAVA_HOME": str(java), "JAVA_OPTS_KC_HEAP": HEAP}
    if password is not None:
        environment["KC_DB_PASSWORD"] = password
    done = subprocess.run([str(install_dir(home) / "bin" / "kc.sh"), *args], capture_output=True, text=True,
                          env=environment, check=False)
    if done.returncode != 0:
        raise KeycloakError(f"`kc.sh {args[0]}` failed while moving Keycloak to PostgreSQL: "
                            f"{(done.stdout + done.stderr)[-1500:]}")


def migrate(home: Home, keycloak: KeycloakSettings, java: Path) -> str:
    """Move Keycloak's realms from H2 to a new PostgreSQL cluster; what was done, in words."""
    if h2_open(home):
        raise Conflict("Keycloak still runs on its dev-file database, so its realms cannot be moved to PostgreSQL",
                       hint="`appliance down`, then `appliance up` moves them")
    started = time.monotonic()
    kc_dir = install_dir(home)
    with tempfile.TemporaryDirectory(prefix="keycloak-export-", dir=home.run) as export:
        # Password hashes and client secrets pass through here: run/ is private, and it is removed.
        build(kc_dir, java, BUILD_OPTIONS)
        # Each command names the build options it was built with: without them Keycloak rebuilds for its defaults.
        _kc(home, java, "export", *BUILD_OPTIONS, f"--dir={export}", "--users=same_file")
        realms = sorted(path.name.removesuffix("-realm.json") for path in Path(export).glob("*-realm.json"))
        if keycloak.realm not in realms:
            raise KeycloakError(f"Keycloak's export holds the realms {realms}, not {keycloak.realm!r}: nothing moved")
        build(kc_dir, java, POSTGRES_BUILD_OPTIONS)
        try:
            with postgres.reachable(home, keycloak, loopback=True):
                _kc(home, java, "import", *POSTGRES_BUILD_OPTIONS, f"--dir={export}", "--override=true",
                    f"--db-url={postgres.jdbc_url(keycloak)}", f"--db-username={postgres.db_username(keycloak)}",
                    password=postgres.db_password(home, keycloak))
        except BaseException:
            shutil.rmtree(postgres.data_dir(home), ignore_errors=True)  # half-filled: the next `up` starts over
            raise
    kept = h2_dir(home).with_name(f"h2.moved-to-postgres-{datetime.now(UTC):%Y%m%dT%H%M%SZ}")
    h2_dir(home).rename(kept)
    with contextlib.suppress(OSError):
        kept.chmod(0o700)
    return (f"moved Keycloak's realms {', '.join(realms)} from dev-file to PostgreSQL in "
            f"{time.monotonic() - started:.0f} s; the H2 files are kept in {kept} (remove them once satisfied)")
