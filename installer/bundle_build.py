"""`appliance bundle build`, on a connected machine: the wheels of the appliance and every
dependency (the target's vLLM engine: the CPU or the CUDA build), the pinned Keycloak distribution,
the demo model or a given one, `install.sh` and the file checker, in one directory sealed with a signed manifest
(installer.bundle). The bundle is assembled under a temporary name and renamed when sealed, so a
failed build never leaves something that looks like a bundle."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from appliance.engine_build import REQUIREMENT_LISTS, Engine
from appliance.home import Home
from installer import demo_model, keycloak_dist
from installer.bundle import BundleError, seal

PROJECT = Path(__file__).resolve().parent.parent  # the checkout the bundle is built from
REQUIREMENTS = PROJECT / "requirements"
# Pinned lists shared with bootstrap.sh: the engine build's (appliance.engine_build), the installer's uv.
INSTALLER_LIST = "uv.txt"
PARTS = ("wheels", "keycloak", "model")


@dataclass(frozen=True)
class Built:
    bundle: Path
    fingerprint: str
    part_bytes: dict[str, int]  # wheels, keycloak, model, and everything else ("scripts")
    seconds: float


def wheel_lists(engine: Engine) -> list[Path]:
    """The pinned requirement files whose wheels a bundle for `engine` carries."""
    return [REQUIREMENTS / name for name in (*REQUIREMENT_LISTS[engine], INSTALLER_LIST)]


def build(out: Path, home: Home, key: Ed25519PrivateKey, *, engine: Engine, model: Path | None = None,
          on_step: Callable[[str], None] = lambda s: None) -> Built:
    """Assemble and seal a bundle for `engine` at `out` (which must not exist yet)."""
    if out.exists():
        raise BundleError(f"{out}: exists already; choose a new directory for the bundle")
    if model is not None and not (model / "config.json").is_file():
        raise BundleError(f"--model {model}: not a checkpoint directory (no config.json)")
    started = time.monotonic()
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    (partial / "keycloak").mkdir(parents=True)

    on_step(f"wheels: the pinned dependencies, the {engine.upper()} engine, uv (pip download; kept in "
            f"{home.cache / 'wheels'})")
    _pinned_wheels(wheel_lists(engine), partial / "wheels", home.cache / "wheels")
    on_step("wheels: the appliance itself (pip wheel)")
    # Built with this environment's pinned setuptools: no build environment fetched from an index.
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--disable-pip-version-check",
          "-q", "-w", str(partial / "wheels"), str(PROJECT)], "pip wheel")

    on_step(f"Keycloak {keycloak_dist.VERSION} (SHA-256 checked)")
    zip_path = keycloak_dist.fetch(home)
    shutil.copy2(zip_path, partial / "keycloak" / zip_path.name)

    source = model or demo_model.prepare(home)[0]
    on_step(f"model {source.name}")
    shutil.copytree(source, partial / "model" / source.name, symlinks=False)

    shutil.copy2(Path(__file__).with_name("install.sh"), partial / "install.sh")
    shutil.copy2(Path(__file__).with_name("bundle_files.py"), partial / "bundle-check.py")
    shutil.copy2(REQUIREMENTS / REQUIREMENT_LISTS[engine][0], partial / "requirements.txt")

    on_step("manifest: size and SHA-256 of every file, signed (Ed25519)")
    fingerprint = seal(partial, key, description={
        "appliance": version("appliance"), "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "platform": sys.platform, "engine": engine, "model": source.name})
    partial.rename(out)
    sizes = {part: sum(f.stat().st_size for f in (out / part).rglob("*") if f.is_file()) for part in PARTS}
    sizes["scripts"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) - sum(sizes.values())
    return Built(bundle=out, fingerprint=fingerprint, part_bytes=sizes, seconds=time.monotonic() - started)


def _pinned_wheels(lists: list[Path], target: Path, cache: Path) -> None:
    """The wheels `lists` pin, linked into `target` from `cache`; pip downloads into the cache only
    when some pinned version is not there yet (a rebuild of the same lock fetches nothing)."""
    wanted = {}
    for path in lists:
        for line in path.read_text().splitlines():
            if "==" in line and not line.lstrip().startswith("#"):
                name, _, pinned = line.split("#")[0].strip().partition("==")
                wanted[_normal(name)] = pinned
    if _cached(cache, wanted).keys() != wanted.keys():
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
              "--disable-pip-version-check", "-q", "-d", str(cache),
              *(arg for path in lists for arg in ("-r", str(path)))], "pip download")
    found = _cached(cache, wanted)
    missing = sorted(wanted.keys() - found.keys())
    if missing:
        raise BundleError(f"pip download left no wheel in {cache} for {missing[:5]}")
    target.mkdir(parents=True)
    for wheel in found.values():
        try:
            os.link(wheel, target / wheel.name)
        except OSError:  # another filesystem
            shutil.copy2(wheel, target / wheel.name)


def _cached(cache: Path, wanted: dict[str, str]) -> dict[str, Path]:
    """The wheel in `cache` for each pinned name, where there is one of the pinned version."""
    found = {}
    for wheel in sorted(cache.glob("*.whl")):
        name, pinned = wheel.name.split("-")[:2]
        if wanted.get(_normal(name)) == pinned:
            found[_normal(name)] = wheel
    return found


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _run(command: list[str], what: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()
        raise BundleError(f"{what} failed (exit {result.returncode}): {tail[-1] if tail else 'no output'}")
