"""The move from dev-file to PostgreSQL, its refusals and its failure path, with a stand-in kc.sh
(the real move: tests/integration/test_backup.py): a running Keycloak is not moved, an export
without the appliance's realm moves nothing, and a failed import leaves no half-filled cluster
behind, so the next `up` starts over with the H2 files untouched."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.errors import Conflict
from appliance.home import Home
from appliance.settings import KeycloakSettings
from installer import keycloak_migration, postgres
from installer.keycloak_dist import KeycloakError, install_dir

KC = '''#!/bin/sh
echo "$@" >> "$(dirname "$0")/calls"
case "$1" in
  export) for a in "$@"; do case "$a" in --dir=*) echo '{}' > "${a#--dir=}/$REALM-realm.json";; esac; done;;
  import) [ -z "$FAIL_IMPORT" ] || { echo "import broke" >&2; exit 3; };;
esac
'''


@pytest.fixture
def on_h2(home: Home, monkeypatch: pytest.MonkeyPatch) -> Home:
    """A home with an H2 database and a stand-in Keycloak; PostgreSQL stood in by a directory."""
    kc = install_dir(home) / "bin" / "kc.sh"
    kc.parent.mkdir(parents=True)
    (install_dir(home) / "lib").mkdir()
    kc.write_text(KC)
    kc.chmod(0o755)
    h2 = keycloak_migration.h2_dir(home)
    h2.mkdir(parents=True)
    (h2 / "keycloakdb.mv.db").write_bytes(b"users")
    monkeypatch.setenv("REALM", "appliance")

    @contextlib.contextmanager
    def reachable(home: Home, keycloak: KeycloakSettings, *, loopback: bool = False) -> Iterator[dict[str, str]]:
        (postgres.data_dir(home) / "PG_VERSION").parent.mkdir(parents=True)
        (postgres.data_dir(home) / "PG_VERSION").write_text("18")
        yield {}

    monkeypatch.setattr(postgres, "reachable", reachable)
    return home


def calls(home: Home) -> list[str]:
    return [line.split()[0] for line in (install_dir(home) / "bin" / "calls").read_text().splitlines()]


def test_the_move_exports_then_imports_and_keeps_the_h2_files(on_h2: Home) -> None:
    assert keycloak_migration.needs_migration(on_h2)
    done = keycloak_migration.migrate(on_h2, KeycloakSettings(), Path("/nonexistent-jdk"))
    assert "moved Keycloak's realms appliance from dev-file to PostgreSQL" in done
    assert calls(on_h2) == ["build", "export", "build", "import"]
    assert not keycloak_migration.needs_migration(on_h2)
    [kept] = keycloak_migration.h2_dir(on_h2).parent.glob("h2.moved-to-postgres-*")
    assert (kept / "keycloakdb.mv.db").read_bytes() == b"users"
    assert not list(on_h2.run.glob("keycloak-export-*"))  # the hashes and secrets it held are gone


def test_a_failed_import_leaves_no_half_filled_cluster(on_h2: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAIL_IMPORT", "1")
    with pytest.raises(KeycloakError, match="kc.sh import` failed.*import broke"):
        keycloak_migration.migrate(on_h2, KeycloakSettings(), Path("/nonexistent-jdk"))
    assert not postgres.data_dir(on_h2).exists() and keycloak_migration.needs_migration(on_h2)
    assert not list(on_h2.run.glob("keycloak-export-*"))


def test_an_export_without_the_realm_moves_nothing(on_h2: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REALM", "master")
    with pytest.raises(KeycloakError, match=r"holds the realms \['master'\], not 'appliance': nothing moved"):
        keycloak_migration.migrate(on_h2, KeycloakSettings(), Path("/nonexistent-jdk"))
    assert calls(on_h2) == ["build", "export"] and keycloak_migration.needs_migration(on_h2)


def test_a_running_keycloak_is_not_moved(on_h2: Home) -> None:
    database = keycloak_migration.h2_dir(on_h2) / "keycloakdb.mv.db"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys; f = open(sys.argv[1], 'rb+'); fcntl.lockf(f, fcntl.LOCK_EX); print('held', flush=True); "
        "sys.stdin.read()"), str(database)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(Conflict, match="still runs on its dev-file database"):
            keycloak_migration.migrate(on_h2, KeycloakSettings(), Path("/nonexistent-jdk"))
    finally:
        holder.communicate("")
    assert not (install_dir(on_h2) / "bin" / "calls").exists()
