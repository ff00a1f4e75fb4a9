"""The audit archive against a real S3-compatible server (rclone serve s3, started here), through
the `appliance` CLI: copy, read back, verify the copies, detect tampering in them."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest

from audit import AuditWriter, signing_key
from tests.integration.conftest import client, s3_settings
from tests.support.appliances import Appliance, make_appliance
from tests.support.audit import event
from tests.support.ports import free_port

BUCKET = "audit-archive"


@pytest.fixture
def appliance(s3: str) -> Iterator[Appliance]:
    yield from make_appliance(None, APPLIANCE_ARTIFACTS__S3_BUCKET=BUCKET, **s3_settings(s3))


def fill_log(appliance: Appliance, count: int = 150) -> None:
    writer = AuditWriter(appliance.home.audit, signing_key(appliance.home), checkpoint_every=20,
                         max_file_bytes=4096)
    for n in range(count):
        writer.append(event(n))


def test_archive_round_trip(appliance: Appliance, s3: str) -> None:
    fill_log(appliance)
    appliance.env["APPLIANCE_AUDIT__ARCHIVE_REQUIRE_LOCK"] = "false"
    archived = appliance.run("audit", "archive", timeout=120)
    assert archived.returncode == 0, archived.stderr
    # rclone's S3 server accepts Object Lock headers but keeps no retention: the CLI says so.
    assert f"archived to http://{s3}/{BUCKET}: audit-000001.jsonl" in archived.stdout
    assert "NOT write-once" in archived.stdout
    names = [o.object_name for o in client(s3).list_objects(BUCKET, prefix="audit/", recursive=True)]
    assert "audit/audit-000001.jsonl" in names and any("checkpoints-" in n for n in names)
    local = (appliance.home.audit / "audit-000001.jsonl").read_bytes()
    assert client(s3).get_object(BUCKET, "audit/audit-000001.jsonl").read() == local

    again = appliance.run("audit", "archive", timeout=120)
    assert "nothing new" in again.stdout, again.stdout
    verified = appliance.run("audit", "verify", "--from-archive", timeout=120)
    assert verified.returncode == 0 and f"audit log OK (archive http://{s3}/{BUCKET})" in verified.stdout, \
        verified.stderr

    # Someone with write access to the bucket edits a record: verify names it.
    edited = local.replace(b'"status":200', b'"status":500', 1)
    client(s3).put_object(BUCKET, "audit/audit-000001.jsonl", io.BytesIO(edited), len(edited))
    tampered = appliance.run("audit", "verify", "--from-archive", timeout=120)
    assert tampered.returncode == 1
    assert "FAILED verification at audit-000001.jsonl:1 (seq 1): hash mismatch" in tampered.stderr


def test_store_without_object_lock_is_refused_when_required(appliance: Appliance, s3: str) -> None:
    fill_log(appliance)
    refused = appliance.run("audit", "archive", timeout=120)  # archive_require_lock defaults to true
    assert refused.returncode == 1
    assert "does not keep Object Lock retention" in refused.stderr
    assert "archive_require_lock" in refused.stderr
    assert not [o for o in client(s3).list_objects(BUCKET, prefix="audit/", recursive=True)]


def test_unreachable_store_is_a_clear_error(appliance: Appliance) -> None:
    fill_log(appliance, 60)
    appliance.env["APPLIANCE_ARTIFACTS__S3_ENDPOINT"] = f"127.0.0.1:{free_port()}"
    failed = appliance.run("audit", "verify", "--from-archive", timeout=300)
    assert failed.returncode == 1 and "cannot list audit/" in failed.stderr, failed.stderr
