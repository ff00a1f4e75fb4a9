"""Check a bundle's files against its manifest: nothing missing, nothing added, every size and
SHA-256 as listed. Standard library only, so that `install.sh` can run this very file (copied
into the bundle as bundle-check.py, itself listed in the manifest) with the target's python3
before anything is installed; `appliance bundle verify` uses it after checking the signature.

    python3 bundle-check.py BUNDLE    # exit 1 naming the first bad file
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
PUBLIC_KEY = "signing-key.pub"
# The manifest's content in sha256sum's format, signed too: checkable with coreutils and openssl
# alone, before any script of the bundle runs.
SUMS = "SHA256SUMS"
SUMS_SIGNATURE = "SHA256SUMS.sig"
UNLISTED = frozenset({MANIFEST, SIGNATURE, PUBLIC_KEY, SUMS, SUMS_SIGNATURE})
CHUNK = 1 << 20


class BundleFileError(Exception):
    """A file is missing, added, or differs from the manifest."""


class FileEntry(TypedDict):
    """What the manifest lists of one file."""

    bytes: int
    sha256: str


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def listed_files(bundle: Path) -> list[str]:
    """Every file in the bundle but the manifest, its signature and the public key, as POSIX paths.
    A bundle holds only directories and regular files: anything else (a symbolic link, which
    could bring in files the manifest never listed) is refused."""
    names = []
    for directory, subdirectories, files in os.walk(bundle, followlinks=False):
        for name in subdirectories + files:
            path = Path(directory, name)
            if path.is_symlink() or not (path.is_dir() or path.is_file()):
                raise BundleFileError(f"{path}: not a regular file or directory (bundles hold no links)")
        names += [Path(directory, name).relative_to(bundle).as_posix() for name in files]
    return sorted(name for name in names if name not in UNLISTED)


def check_files(bundle: Path, files: dict[str, FileEntry], on_file: Callable[[str], None] = lambda f: None) -> int:
    """Raise BundleFileError at the first file that is added, missing or changed; the total bytes."""
    present = set(listed_files(bundle))
    extra = sorted(present - set(files))
    if extra:
        raise BundleFileError(f"{bundle / extra[0]}: not in the manifest (added after signing)")
    total = 0
    for name, entry in sorted(files.items()):
        path = bundle / name
        if name not in present:
            raise BundleFileError(f"{path}: missing (the manifest lists it)")
        on_file(name)
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise BundleFileError(f"{path}: {size:,} bytes, the manifest says {entry['bytes']:,}")
        if sha256_of(path) != entry["sha256"]:
            raise BundleFileError(f"{path}: SHA-256 differs from the manifest (changed after signing)")
        total += size
    return total


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("usage: bundle-check.py BUNDLE [SHOWN_AS] (after its signature is verified)", file=sys.stderr)
        return 2
    bundle = Path(argv[0])
    shown = argv[1] if len(argv) == 2 else str(bundle)  # install.sh checks a private copy of SHOWN_AS

    def named(message: str) -> str:
        return message.replace(str(bundle), shown)

    try:
        files = json.loads((bundle / MANIFEST).read_bytes())["files"]
        total = check_files(bundle, files)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(named(f"bundle check failed: {bundle / MANIFEST}: unreadable ({exc})"), file=sys.stderr)
        return 1
    except BundleFileError as exc:
        print(named(f"bundle check failed: {exc}"), file=sys.stderr)
        return 1
    print(f"{len(files)} files, {total:,} bytes, as listed in the signed manifest")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
