"""The embedded Keycloak's supervised program: the JDK it runs on, its administrator, its command
(TLS only, on loopback) and, on PostgreSQL, the database program it starts after; an appliance whose
realms are still in the dev-file database has them moved first (installer.keycloak_migration).

The distribution itself (fetch, install, build, where it lives): installer.keycloak_dist.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from appliance.home import Home
from appliance.programs import Program
from appliance.secrets import secret
from appliance.settings import KeycloakSettings, Settings
from appliance.tls import ensure_server_certificate
from installer.keycloak_dist import KeycloakError, build, build_options, data_dir, install_dir
from installer.keycloak_migration import migrate, needs_migration
from installer.postgres import db_password, db_username, jdbc_url, postgres_program

ADMIN_USER = "kcadmin"
ADMIN_SECRET = "keycloak-admin-password"
# Keycloak 26.6+ runs on Java 25; 17 still works (deprecated).
JDK_CANDIDATES = ("/usr/lib/jvm/temurin-25-jdk-amd64", "/usr/lib/jvm/java-17-openjdk-amd64")


def java_home(keycloak: KeycloakSettings) -> Path:
    """The JDK to run Keycloak with: the setting, else the first installed candidate."""
    candidates = [keycloak.java_home] if keycloak.java_home else list(JDK_CANDIDATES)
    for candidate in candidates:
        if candidate and (Path(candidate) / "bin" / "java").is_file():
            return Path(candidate)
    raise KeycloakError(
        f"no JDK for Keycloak found (looked in {', '.join(c for c in candidates if c)})",
        hint="install a JDK 17+ (e.g. apt install openjdk-17-jre-headless) or set keycloak.java_home",
    )


def java_version(java: Path) -> str:
    """`java -version`'s first line, for preflight and status."""
    result = subprocess.run([str(java / "bin" / "java"), "-version"], capture_output=True, text=True,
                            check=False)
    return (result.stderr or result.stdout).splitlines()[0] if (result.stderr or result.stdout) else ""


def keycloak_programs(settings: Settings, home: Home) -> list[Program]:
    """The supervised `keycloak` program (the `appliance.programs` entry point), if embedded."""
    keycloak = settings.keycloak
    if keycloak.mode != "embedded":
        return []
    kc_dir = install_dir(home)
    data_dir(home).mkdir(parents=True, exist_ok=True)  # a copied install links to it
    missing = None if (kc_dir / "bin" / "kc.sh").is_file() else (
        f"Keycloak not installed at {kc_dir} (run ./bootstrap.sh, or `appliance keycloak install`)")
    try:
        jdk = str(java_home(keycloak))
    except KeycloakError as exc:
        jdk, missing = "", missing or exc.message
    base = keycloak.base_url
    certificate, private_key = ensure_server_certificate(home, "keycloak")
    on_postgres = keycloak.database == "postgres"
    command = [
        # The production server: development mode would open a plain-HTTP listener whatever it is told.
        str(kc_dir / "bin" / "kc.sh"), "start", *build_options(keycloak),
        "--cache=local",  # one node: no JGroups cluster listeners on the host's interfaces
        # TLS only, with the appliance CA's certificate: clients authenticate Keycloak before they
        # trust its keys or send it a secret (the management port inherits the same TLS).
        "--http-enabled=false", "--http-host=127.0.0.1", f"--https-port={keycloak.port}",
        f"--https-certificate-file={certificate}", f"--https-certificate-key-file={private_key}",
        f"--http-management-port={keycloak.management_port}",
        # A fixed hostname keeps `iss` identical whichever loopback name a client uses.
        f"--hostname={base}",
        "--health-enabled=true",
    ]
    if keycloak.frontend_url:
        # Published through the gateway (the realm's frontend URL, installer.realm): it forwards a
        # workstation's login with X-Forwarded-For, which names the source in Keycloak's events,
        # believed from loopback only.
        command += ["--proxy-headers=xforwarded", "--proxy-trusted-addresses=127.0.0.1/32"]
    env = {
        "JAVA_HOME": jdk,
        "KC_BOOTSTRAP_ADMIN_USERNAME": ADMIN_USER,
        "KC_BOOTSTRAP_ADMIN_PASSWORD": secret(home, ADMIN_SECRET),
        # Keycloak sizes its heap from host RAM by default (70%): far too much beside engines.
        "JAVA_OPTS_KC_HEAP": "-Xms64m -Xmx768m",
        # Virtual threads misbehave on few cores in 26.6.x.
        "JAVA_OPTS_APPEND": "-Dorg.infinispan.threads.virtual=false",
    }
    programs = []
    if on_postgres and not missing:
        if needs_migration(home) and keycloak.external_postgres is not None:
            raise KeycloakError("this appliance's realms are in Keycloak's dev-file database: they move only into "
                                "the appliance's own PostgreSQL", hint="start once without keycloak.postgres_url "
                                "(they move at `up`), then back them up and restore them into the external server")
        if needs_migration(home):  # an appliance from before PostgreSQL: its realms move once
            print("moving Keycloak's realms from its dev-file database to PostgreSQL (a few minutes)",
                  file=sys.stderr, flush=True)
            print(migrate(home, keycloak, Path(jdk)), file=sys.stderr, flush=True)
        # The password goes by the environment (KC_DB_PASSWORD), never the command line.
        command += [f"--db-url={jdbc_url(keycloak)}", f"--db-username={db_username(keycloak)}"]
        env["KC_DB_PASSWORD"] = db_password(home, keycloak)
        if keycloak.external_postgres is None:
            # Its database first; Keycloak starts once it accepts connections.
            programs.append(postgres_program(home, keycloak.postgres_port, settings.engine.yield_nice))
            command = [sys.executable, "-P", "-m", "installer.wait_for_database", str(keycloak.postgres_port), "60",
                       "--", *command]
    if not missing:
        build(kc_dir, Path(jdk), build_options(keycloak))  # when the database changed: `--db` is a build option
    return [*programs, Program(
        name="keycloak", command=command, environment=env, directory=kc_dir,
        port=keycloak.port, health_url=f"https://127.0.0.1:{keycloak.management_port}/health/ready",
        urls={"issuer": keycloak.issuer, "admin": f"{base}/admin/"},
        priority=10, startsecs=5, stopwaitsecs=30, start_timeout_s=keycloak.start_timeout_s,
        start_nice=settings.engine.yield_nice, missing=missing,
    )]
