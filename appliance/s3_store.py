"""The artifact store on an S3-compatible server (appliance.artifacts' `ArtifactStore`), through
the `minio` SDK: a bucket created with Object Lock enabled when missing, objects put with
retention in COMPLIANCE mode where the bucket allows it."""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import BinaryIO

from minio import Minio
from minio.commonconfig import COMPLIANCE
from minio.error import MinioException
from minio.retention import Retention
from urllib3.exceptions import HTTPError

from appliance.errors import ArtifactStoreError
from appliance.settings import ArtifactSettings


class S3Store:
    """A bucket on an S3-compatible server, created with Object Lock enabled when missing."""

    can_lock = True

    def __init__(self, settings: ArtifactSettings, bucket: str | None = None) -> None:
        self.bucket = bucket or settings.s3_bucket
        scheme = "https" if settings.s3_secure else "http"
        self.location = f"{scheme}://{settings.s3_endpoint}/{self.bucket}"
        self._client = Minio(str(settings.s3_endpoint), access_key=settings.s3_access_key,
                             secret_key=settings.s3_secret_key, secure=settings.s3_secure,
                             region=settings.s3_region)
        self._ready = False
        self._write_once: bool | None = None

    def put(self, key: str, data: bytes | BinaryIO, *, retain_days: int) -> None:
        until = (datetime.now(UTC) + timedelta(days=retain_days)).replace(microsecond=0)
        source = io.BytesIO(data) if isinstance(data, bytes) else data
        length = source.seek(0, io.SEEK_END)
        source.seek(0)
        with self._errors(f"write {key}"):
            self._ensure_bucket()
            self._client.put_object(self.bucket, key, source, length,
                                    retention=Retention(COMPLIANCE, until) if retain_days > 0 else None)

    def write_once(self) -> bool:
        """Put a small probe object with one day's retention and read the retention back: some
        servers accept Object Lock headers and ignore them."""
        if self._write_once is None:
            key = f".lock-probe/{datetime.now(UTC):%Y%m%dT%H%M%S%fZ}"
            self.put(key, b"", retain_days=1)
            try:
                kept = self._client.get_object_retention(self.bucket, key)
                self._write_once = kept is not None and kept.mode == COMPLIANCE
            except (MinioException, ValueError, SyntaxError):
                self._write_once = False  # no retention to show: no Object Lock here
        return self._write_once

    def size_and_etag(self, key: str) -> tuple[int, str]:
        with self._errors(f"stat {key}"):
            stat = self._client.stat_object(self.bucket, key)
            return int(stat.size or 0), str(stat.etag or "").strip('"')

    def get(self, key: str, offset: int = 0, length: int = 0) -> bytes:
        """The object's bytes, or `length` of them from `offset` (a ranged GET)."""
        with self._errors(f"read {key}"):
            response = self._client.get_object(self.bucket, key, offset=offset, length=length)
            try:
                return response.read()
            finally:
                response.close()
                response.release_conn()

    def delete(self, key: str) -> None:
        """Every version of `key` (the bucket keeps versions under Object Lock: removing the key
        alone would only hide it)."""
        with self._errors(f"remove {key}"):
            for found in self._client.list_objects(self.bucket, prefix=key, include_version=True):
                if found.object_name == key:
                    self._client.remove_object(self.bucket, key, version_id=found.version_id)

    def keys(self, prefix: str) -> list[str]:
        with self._errors(f"list {prefix}"):
            if not self._client.bucket_exists(self.bucket):
                return []
            return sorted(o.object_name for o in self._client.list_objects(self.bucket, prefix=prefix,
                                                                           recursive=True))

    def _ensure_bucket(self) -> None:
        if not self._ready and not self._client.bucket_exists(self.bucket):
            self._client.make_bucket(self.bucket, object_lock=True)
        self._ready = True

    @contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        """The SDK's and the network's errors as one clear ArtifactStoreError."""
        try:
            yield
        except (MinioException, HTTPError, OSError, ValueError) as exc:
            raise ArtifactStoreError(f"S3 store {self.location}: cannot {what}: {exc}") from exc
