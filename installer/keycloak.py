"""The embedded Keycloak: a pinned server distribution from Maven Central, a JDK to run it, and
its supervised program.

The distribution is unpacked into the state directory, so its dev-file database (users, realm)
lives with the rest of the appliance's state.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx

from appliance.digest import sha256_file
from appliance.errors import ApplianceError
from appliance.home import Home
from appliance.programs import Program
from appliance.progress import byte_progress
from appliance.secrets import secret
from appliance.settings import KeycloakSettings, Settings
from appliance.tls import ensure_server_certificate
from installer.postgres import db_password, db_username, jdbc_url, postgres_program

VERSION = "26.7.3"
SHA256 = "27a6535553c3cdcd083872ba40629efafb3475e3b758e0c6f691395561dd0f1f"
URL = (f"https://repo1.maven.org/maven2/org/keycloak/keycloak-quarkus-dist/{VERSION}/"
       f"keycloak-quarkus-dist-{VERSION}.zip")
ADMIN_USER = "kcadmin"
ADMIN_SECRET = "keycloak-admin-password"
# Keycloak 26.6+ runs on Java 25; 17 still works (deprecated).
JDK_CANDIDATES = ("/usr/lib/jvm/temurin-25-jdk-amd64", "/usr/lib/jvm/java-17-openjdk-amd64")
# Build-time options of the production server: Keycloak's build step (Quarkus augmentation, ~20 s)
# bakes them in once at install, so each start is quick. `start` rebuilds if they ever differ.
BUILD_OPTIONS = ("--db=dev-file", "--health-enabled=true")
POSTGRES_BUILD_OPTIONS = ("--db=postgres", "--health-enabled=true")
BUILT_MARKER = ".appliance-build"


class KeycloakError(ApplianceError):
    """The embedded Keycloak cannot be fetched, installed or run."""


def install_dir(home: Home) -> Path:
    return home.root / "keycloak" / f"keycloak-{VERSION}"


def data_dir(home: Home) -> Path:
    """Keycloak's database (users, realm) and transaction logs: beside the versioned install, which
    links to it, so installing another Keycloak version keeps them."""
    return home.root / "keycloak" / "data"


def _share_data(target: Path, home: Home) -> None:
    """Point the install's data/ at the shared data dir (moving a database an older layout kept inside)."""
    inside = target / "data"
    if inside.is_symlink():
        return
    if inside.is_dir() and not data_dir(home).exists():
        inside.rename(data_dir(home))
    elif inside.exists():
        raise KeycloakError(f"{inside} and {data_dir(home)} both hold Keycloak data; keep one and remove the other")
    data_dir(home).mkdir(parents=True, exist_ok=True)
    inside.symlink_to(Path("..") / "data")


def build_options(keycloak: KeycloakSettings) -> tuple[str, ...]:
    return POSTGRES_BUILD_OPTIONS if keycloak.database == "postgres" else BUILD_OPTIONS


def install(home: Home, java: Path, options: tuple[str, ...] = POSTGRES_BUILD_OPTIONS) -> tuple[Path, bool]:
    """Fetch (SHA-256 checked), unpack and build the distribution once, for `options` (see
    build_options); return (its dir, whether made)."""
    target = install_dir(home)
    if (target / "bin" / "kc.sh").is_file():
        _share_data(target, home)
        return target, build(target, java, options)  # an install made before the build step
    zip_path = fetch(home)
    partial = target.with_name(f".{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    with zipfile.ZipFile(zip_path) as archive, byte_progress() as progress:
        members = archive.infolist()
        task = progress.add_task(f"unpack keycloak {VERSION}", total=sum(m.file_size for m in members))
        prefix = f"keycloak-{VERSION}/"
        for member in members:
            name = member.filename.removeprefix(prefix)
            if not name or name.startswith(("/", "..")) or "/../" in name:
                continue
            dest = partial / name
            if member.is_dir():
                dest.mkdir(parents=True, exist_ok=True)
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(member) as src, dest.open("wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
            # zip keeps the Unix mode in the high bits of external_attr (kc.sh is executable).
            mode = (member.external_attr >> 16) & 0o777
            if mode:
                os.chmod(dest, mode)
            progress.advance(task, member.file_size)
    partial.rename(target)
    _share_data(target, home)
    build(target, java, options)
    return target, True


def build(target: Path, java: Path, options: tuple[str, ...] = BUILD_OPTIONS) -> bool:
    """Run Keycloak's build step with `options` unless this install already has; return whether run."""
    marker = target / "lib" / BUILT_MARKER
    wanted = " ".join(options)
    if marker.is_file() and marker.read_text() == wanted:
        return False
    result = subprocess.run([str(target / "bin" / "kc.sh"), "build", *options], capture_output=True,
                            text=True, env={**os.environ, "JAVA_HOME": str(java)}, check=False)
    if result.returncode != 0:
        raise KeycloakError(f"`kc.sh build` failed in {target}: {(result.stdout + result.stderr)[-2000:]}")
    marker.write_text(wanted)
    return True


def fetch(home: Home) -> Path:
    """The pinned distribution zip in the cache, downloaded (SHA-256 checked) if it is not there."""
    path = home.cache / Path(URL).name
    if path.exists() and sha256_file(path) == SHA256:
        return path
    part = path.with_suffix(".part")
    try:
        with httpx.stream("GET", URL, follow_redirects=True, timeout=60) as response:
            response.raise_for_status()
            total = int(response.headers.get("content-length", 0)) or None
            with part.open("wb") as out, byte_progress() as progress:
                task = progress.add_task(f"download keycloak {VERSION}", total=total)
                for chunk in response.iter_bytes(1 << 20):
                    out.write(chunk)
                    progress.advance(task, len(chunk))
    except httpx.HTTPError as exc:
        raise KeycloakError(f"cannot download {URL}: {exc}") from exc
    actual = sha256_file(part)
    if actual != SHA256:
        part.unlink()
        raise KeycloakError(f"{URL}: SHA-256 {actual} is not the pinned {SHA256}")
    part.rename(path)
    return path


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
        from installer.keycloak_migration import migrate, needs_migration

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
