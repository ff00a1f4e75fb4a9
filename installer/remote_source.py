"""A checkpoint in an S3-compatible bucket (`s3://bucket/prefix`), fetched into a local directory
before staging: parallel ranged GETs written in place, each file checked against its size and,
when the ETag is a plain MD5 (single-part uploads), its MD5; finished files are kept, so an
interrupted fetch resumes."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from appliance.errors import ApplianceError
from appliance.s3_store import S3Store
from appliance.settings import ArtifactSettings

RANGE = 32 << 20
CHECKED = ".fetched"  # a hidden marker beside each file that was fetched and checked


class RemoteSourceError(ApplianceError):
    """The remote checkpoint cannot be fetched as it should."""


def parse_s3_url(url: str) -> tuple[str, str]:
    """('bucket', 'prefix/') from s3://bucket/prefix."""
    rest = url.removeprefix("s3://")
    bucket, _, prefix = rest.partition("/")
    if not url.startswith("s3://") or not bucket or not prefix:
        raise RemoteSourceError(f"{url!r} is not an s3://BUCKET/PREFIX address")
    return bucket, prefix.rstrip("/") + "/"


def relative_key(key: str, prefix: str) -> str:
    """The path of an object below the prefix, refused (naming the key) if it could land outside
    the target directory: '..' or '.' segments, empty segments, an absolute path, a backslash or
    a control character."""
    relative = key[len(prefix):]
    segments = relative.split("/")
    if (not key.startswith(prefix) or relative.startswith("/") or any(s in ("", ".", "..") for s in segments)
            or "\\" in relative or any(ord(c) < 0x20 or ord(c) == 0x7F for c in relative)):
        raise RemoteSourceError(f"object key {key!r} is not a plain relative path below {prefix!r}; refusing it",
                                hint="remove or rename the object in the bucket")
    return relative


def fetch_checkpoint(url: str, into: Path, settings: ArtifactSettings, *, workers: int = 8,
                     on_bytes: Callable[[int], None] = lambda n: None,
                     on_total: Callable[[int], None] = lambda n: None) -> Path:
    """Download every object under the prefix into `into`; return `into`."""
    if settings.s3_endpoint is None:
        raise RemoteSourceError(f"{url}: no S3 server configured", hint="set artifacts.s3_endpoint and its keys")
    bucket, prefix = parse_s3_url(url)
    store = S3Store(settings, bucket=bucket)
    keys = [key for key in store.keys(prefix) if not key.endswith("/")]
    targets = {key: into / relative_key(key, prefix) for key in keys}  # every key checked before any write
    if not any(key.endswith("config.json") for key in keys):
        raise RemoteSourceError(f"{url}: no config.json under this prefix ({len(keys)} objects)")
    into.mkdir(parents=True, exist_ok=True)
    sizes = {key: store.size_and_etag(key) for key in keys}
    on_total(sum(size for size, _ in sizes.values()))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for key in keys:
            target = targets[key]
            size, etag = sizes[key]
            if _already_fetched(target, size, etag):
                on_bytes(size)
                continue
            _fetch(store, pool, key, target, size, etag, on_bytes)
    return into


def _already_fetched(target: Path, size: int, etag: str) -> bool:
    marker = _marker(target)
    return target.is_file() and target.stat().st_size == size and marker.is_file() and marker.read_text() == etag


def _fetch(store: S3Store, pool: ThreadPoolExecutor, key: str, target: Path, size: int, etag: str,
           on_bytes: Callable[[int], None]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, size)

        def piece(offset: int) -> None:
            data = store.get(key, offset, min(RANGE, size - offset))
            if len(data) != min(RANGE, size - offset):
                raise RemoteSourceError(f"{key}: short read at byte {offset:,}")
            os.pwrite(fd, data, offset)
            on_bytes(len(data))

        list(pool.map(piece, range(0, size, RANGE)))
        os.fsync(fd)
    finally:
        os.close(fd)
    if "-" not in etag and len(etag) == 32 and _md5(partial) != etag:  # a multipart ETag is no MD5
        raise RemoteSourceError(f"{key}: MD5 of the download differs from the object's ETag {etag}")
    os.replace(partial, target)
    _marker(target).write_text(etag)


def _marker(target: Path) -> Path:
    return target.with_name(f".{target.name}{CHECKED}")


def _md5(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with path.open("rb") as handle:
        while block := handle.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()
