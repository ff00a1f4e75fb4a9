"""The artifact store: copies that outlive this host's state dir (audit archives, later adapters
and bundles). A local directory by default, or an S3-compatible bucket through the `minio` SDK.

Write-once where the backend can: on S3, objects are put with Object Lock retention in COMPLIANCE
mode, and the retention is read back, so the caller knows whether the server actually keeps it
(some S3-compatible servers accept the header and ignore it). Locally, copies are made read-only.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO, Protocol

from appliance.durable import replace_file
from appliance.errors import ArtifactStoreError
from appliance.home import Home
from appliance.settings import ArtifactSettings


class ArtifactStore(Protocol):
    location: str
    can_lock: bool  # the backend offers write-once retention (S3 Object Lock)

    def put(self, key: str, data: bytes | BinaryIO, *, retain_days: int) -> None:
        """Store `data` (bytes, or a seekable binary file copied from its start in pieces) under
        `key`, locked against change for `retain_days` (if > 0) where the backend can."""

    def write_once(self) -> bool:
        """Whether copies put here really are locked (probed against the server, once)."""

    def get(self, key: str) -> bytes: ...

    def keys(self, prefix: str) -> list[str]:
        """Keys under `prefix`, sorted."""

    def delete(self, key: str) -> None:
        """Remove `key` (one stored without retention; a missing key is no error)."""


class LocalStore:
    """A directory; each key a file, written atomically and left read-only."""

    can_lock = False

    def __init__(self, root: Path) -> None:
        self.root = root
        self.location = str(root)

    def write_once(self) -> bool:
        return False  # read-only files, but the host's root can still change them

    def put(self, key: str, data: bytes | BinaryIO, *, retain_days: int) -> None:
        path = self._path(key)
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not isinstance(data, bytes):
                data.seek(0)
            replace_file(path, data, mode=0o400)
        except OSError as exc:
            raise ArtifactStoreError(f"cannot write {path}: {exc.strerror or exc}") from exc

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except OSError as exc:
            raise ArtifactStoreError(f"cannot read {self._path(key)}: {exc.strerror or exc}") from exc

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as exc:
            raise ArtifactStoreError(f"cannot remove {self._path(key)}: {exc.strerror or exc}") from exc

    def keys(self, prefix: str) -> list[str]:
        base = self._path(prefix)
        if not base.is_dir():
            return []
        return sorted(str(p.relative_to(self.root)) for p in base.rglob("*")
                      if p.is_file() and not p.name.startswith(".tmp-"))

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if not path.is_relative_to(self.root.resolve()):
            raise ArtifactStoreError(f"artifact key {key!r} leaves the store")
        return path


def artifact_store(settings: ArtifactSettings, home: Home) -> ArtifactStore:
    """The store the settings name."""
    if settings.store == "s3":
        from appliance.s3_store import S3Store  # the S3 SDK only where a bucket is the store (0.4 s to import)

        return S3Store(settings)
    return LocalStore(Path(settings.path) if settings.path else home.root / "artifacts")
