"""Keycloak's server distribution: the pinned zip from Maven Central (SHA-256 checked), unpacked
into the state directory and built for its database; where the install and its data live.

The install's data/ links to a data directory beside it, so its dev-file database (users, realm)
lives with the rest of the appliance's state and outlasts a version change.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import httpx

from appliance.digest import sha256_file
from appliance.errors import ApplianceError
from appliance.home import Home
from appliance.progress import byte_progress
from appliance.settings import KeycloakSettings

VERSION = "26.7.3"
SHA256 = "27a6535553c3cdcd083872ba40629efafb3475e3b758e0c6f691395561dd0f1f"
URL = (f"https://repo1.maven.org/maven2/org/keycloak/keycloak-quarkus-dist/{VERSION}/"
       f"keycloak-quarkus-dist-{VERSION}.zip")
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
