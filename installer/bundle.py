"""The air-gapped bundle: everything the appliance needs, one directory, checked before use.

A bundle holds `wheels/` (the project and every dependency for the target), `keycloak/` (the
server distribution), `model/` (the demo model or a given one) and `install.sh`, plus
`manifest.json` listing every other file with its size and SHA-256, signed with Ed25519 in
`manifest.sig`; `signing-key.pub` travels along, and its fingerprint is compared out of band.
Verification trusts nothing in the bundle before the signature: signature first (against a
key the operator supplies, else the bundled one whose fingerprint it prints), then every file,
and no file missing or extra. For removable media a bundle can travel as a tar split into
parts, with the parts' SHA-256 in a list beside them.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from appliance.digest import sha256_file
from appliance.errors import ApplianceError
from installer.bundle_files import (
    MANIFEST,
    PUBLIC_KEY,
    SIGNATURE,
    SUMS,
    SUMS_SIGNATURE,
    BundleFileError,
    FileEntry,
    check_files,
    listed_files,
)

PARTS_LIST = "parts.sha256"


class BundleError(ApplianceError):
    """A bundle is incomplete, altered or not signed by the trusted key."""


@dataclass(frozen=True)
class Verified:
    files: int
    bytes: int
    fingerprint: str  # of the key that signed the manifest


def fingerprint(key: Ed25519PublicKey) -> str:
    """SHA-256 of the raw public key, as hex in groups of four, for reading aloud."""
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    digest = hashlib.sha256(raw).hexdigest()
    return ":".join(digest[i:i + 4] for i in range(0, len(digest), 4))


def load_or_create_key(path: Path) -> Ed25519PrivateKey:
    """The signing key at `path` (PEM), generated and stored 0600 if there is none."""
    if path.exists():
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (ValueError, TypeError) as exc:
            raise BundleError(f"{path}: not a PEM private key ({exc})") from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise BundleError(f"{path}: not an Ed25519 key")
        return key
    key = Ed25519PrivateKey.generate()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return key


def load_public_key(path: Path) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise BundleError(f"{path}: not a readable PEM public key ({exc})") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise BundleError(f"{path}: not an Ed25519 public key")
    return key


def seal(bundle: Path, key: Ed25519PrivateKey, *, description: dict[str, str],
         on_file: Callable[[str], None] = lambda f: None) -> str:
    """Write the manifest of every file in `bundle` and sign it; returns the key's fingerprint."""
    files: dict[str, FileEntry] = {}
    for name in listed_files(bundle):
        on_file(name)
        path = bundle / name
        files[name] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    manifest = {"format": 1, "created": datetime.now(UTC).isoformat(timespec="seconds"), **description,
                "files": files}
    raw = json.dumps(manifest, indent=1, sort_keys=True).encode()
    (bundle / MANIFEST).write_bytes(raw)
    (bundle / SIGNATURE).write_text(base64.b64encode(key.sign(raw)).decode() + "\n")
    sums = "".join(f"{entry['sha256']}  {name}\n" for name, entry in sorted(files.items())).encode()
    (bundle / SUMS).write_bytes(sums)
    (bundle / SUMS_SIGNATURE).write_text(base64.b64encode(key.sign(sums)).decode() + "\n")
    public = key.public_key()
    (bundle / PUBLIC_KEY).write_bytes(public.public_bytes(serialization.Encoding.PEM,
                                                          serialization.PublicFormat.SubjectPublicKeyInfo))
    return fingerprint(public)


def verify(bundle: Path, trusted: Ed25519PublicKey | None = None,
           on_file: Callable[[str], None] = lambda f: None) -> Verified:
    """Check the signature (against `trusted`, else the bundled key), then every file; the first
    fault is a BundleError naming the file."""
    if not bundle.is_dir():
        raise BundleError(f"{bundle}: not a bundle directory")
    for name in (MANIFEST, SIGNATURE):
        if not (bundle / name).is_file():
            raise BundleError(f"{bundle / name}: missing (not a signed bundle)")
    key = trusted or load_public_key(bundle / PUBLIC_KEY)
    raw = (bundle / MANIFEST).read_bytes()
    try:
        key.verify(base64.b64decode((bundle / SIGNATURE).read_text().strip(), validate=True), raw)
    except (InvalidSignature, ValueError) as exc:
        raise BundleError(f"{bundle / MANIFEST}: the signature does not match "
                          f"{'the trusted key' if trusted else 'the bundled key'} ({fingerprint(key)}): the "
                          "manifest was changed or signed by another key") from exc
    try:
        files = json.loads(raw)["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise BundleError(f"{bundle / MANIFEST}: signed but unreadable ({exc})") from exc
    try:
        total = check_files(bundle, files, on_file)
    except BundleFileError as exc:
        raise BundleError(str(exc)) from None
    return Verified(files=len(files), bytes=total, fingerprint=fingerprint(key))


def verification_commands(bundle: Path, key_fingerprint: str) -> list[str]:
    """What an operator runs on the target, with openssl and coreutils only, before any script
    of the bundle: the key's fingerprint, the signature of the checksum list, every checksum."""
    plain = key_fingerprint.replace(":", "")
    where = bundle.name
    return [
        f"openssl pkey -pubin -in builder.pub -outform DER | tail -c 32 | sha256sum   # must print {plain}",
        f"base64 -d {where}/{SUMS_SIGNATURE} > sums.sig && openssl pkeyutl -verify -pubin -inkey builder.pub "
        f"-rawin -in {where}/{SUMS} -sigfile sums.sig   # must print: Signature Verified Successfully",
        f"(cd {where} && sha256sum --quiet --strict -c {SUMS})   # must print nothing and exit 0",
    ]


def split(bundle: Path, out: Path, part_bytes: int) -> list[Path]:
    """The bundle as one tar cut into parts of at most `part_bytes`, with their SHA-256 list."""
    if part_bytes <= 0:
        raise BundleError("--part-size must be positive")
    out.mkdir(parents=True, exist_ok=True)
    archive = out / f"{bundle.name}.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(bundle, arcname=bundle.name)
    parts: list[Path] = []
    with archive.open("rb") as whole:
        while chunk := whole.read(part_bytes):
            part = out / f"{archive.name}.part{len(parts):03d}"
            part.write_bytes(chunk)
            parts.append(part)
    archive.unlink()
    (out / PARTS_LIST).write_text("".join(f"{sha256_file(p)}  {p.name}\n" for p in parts))
    return parts


def join(parts_dir: Path, out: Path) -> Path:
    """Check every part against the list, join and unpack them into `out`; returns the bundle."""
    listing = parts_dir / PARTS_LIST
    if not listing.is_file():
        raise BundleError(f"{listing}: missing (not a split bundle)")
    names = []
    for number, line in enumerate(listing.read_text().splitlines(), 1):
        digest, _, name = line.partition("  ")
        part = parts_dir / name
        if not part.is_file():
            raise BundleError(f"{part}: missing ({listing}:{number} lists it)")
        if sha256_file(part) != digest:
            raise BundleError(f"{part}: SHA-256 differs from {listing}:{number}")
        names.append(name)
    out.mkdir(parents=True, exist_ok=True)
    archive = out / ".bundle.tar"
    with archive.open("wb") as whole:
        for name in names:
            with (parts_dir / name).open("rb") as piece:
                shutil.copyfileobj(piece, whole)
    try:
        with tarfile.open(archive) as tar:
            root = _unpack(tar, out, parts_dir)
    finally:
        archive.unlink()
    return out / root


def _unpack(tar: tarfile.TarFile, out: Path, parts_dir: Path) -> str:
    """Extract a bundle's tar by hand, member by member, after checking every member: one root
    directory, plain relative names (no '..', no absolute path), only regular files and
    directories (no links, devices or FIFOs), written 0644/0755 whatever the tar says. This
    does not depend on the running Python's tarfile extraction filters."""
    members = tar.getmembers()
    roots = {member.name.split("/")[0] for member in members}
    if len(roots) != 1:
        raise BundleError(f"{parts_dir}: the parts do not hold one bundle directory")
    for member in members:
        segments = member.name.split("/")
        if member.name.startswith("/") or any(s in ("", ".", "..") for s in segments) or "\\" in member.name:
            raise BundleError(f"{parts_dir}: the archive names {member.name!r}, not a plain relative path")
        if not (member.isfile() or member.isdir()):
            raise BundleError(f"{parts_dir}: {member.name!r} in the archive is not a regular file or directory")
    for member in members:
        target = out.joinpath(*member.name.split("/"))
        if member.isdir():
            target.mkdir(mode=0o755, parents=True, exist_ok=True)
            continue
        target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        source = tar.extractfile(member)
        assert source is not None  # a regular file
        with source, open(target, "xb") as written:
            shutil.copyfileobj(source, written)
        target.chmod(0o644)
    return roots.pop()
