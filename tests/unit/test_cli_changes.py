"""CLI changes on this host leave audit records of the local user, whether they succeed or fail."""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import threading
from collections.abc import Iterator

import pytest

from audit import read_records, verify
from audit.keys import signing_key
from tests.support.appliances import APPLIANCE, Appliance, make_appliance
from tests.support.ports import free_port

pytestmark = pytest.mark.integration  # every test here starts processes


@pytest.fixture
def appliance() -> Iterator[Appliance]:
    yield from make_appliance(None)


def test_cli_changes_are_recorded_with_their_outcome(appliance: Appliance) -> None:
    assert appliance.run("down").returncode == 0
    appliance.env.update({"APPLIANCE_ARTIFACTS__STORE": "s3",
                          "APPLIANCE_ARTIFACTS__S3_ENDPOINT": f"127.0.0.1:{free_port()}",
                          "APPLIANCE_ARTIFACTS__S3_ACCESS_KEY": "k", "APPLIANCE_ARTIFACTS__S3_SECRET_KEY": "s"})
    failed = appliance.run("audit", "archive", timeout=300)
    assert failed.returncode == 1
    down, archive = read_records(appliance.home.audit)
    assert (down["action"], down["outcome"], down["status"], down["client"], down["source"]) == \
        ("appliance.down", "allowed", 0, "appliance-cli", "local")
    assert down["username"] and down["subject"].startswith("uid:")
    assert (archive["action"], archive["outcome"], archive["status"]) == ("audit.archive", "error", 1)
    assert "cannot" in archive["error"] and archive["resource"] == "cli"
    assert verify(appliance.home.audit, signing_key(appliance.home).public_key()).records == 2


def test_unwritable_audit_log_fails_the_command_and_says_so(appliance: Appliance) -> None:
    appliance.home.audit.mkdir(parents=True, exist_ok=True)
    (appliance.home.audit / "audit-000001.jsonl").write_bytes(b"not json\n")
    result = appliance.run("down")
    assert result.returncode == 1
    assert "appliance.down ran, but its audit record could not be written" in result.stderr


def test_audit_tail_prints_the_last_records_then_only_new_ones(appliance: Appliance) -> None:
    for _ in range(3):
        assert appliance.run("down").returncode == 0  # each leaves a record
    last_two = appliance.run("audit", "tail", "-n", "2")
    assert [json.loads(line)["seq"] for line in last_two.stdout.splitlines()] == [2, 3]
    follow = subprocess.Popen([APPLIANCE, "audit", "tail", "-n", "0", "-f"], env=appliance.env,
                              stdout=subprocess.PIPE, text=True)
    printed: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [printed.put(line) for line in follow.stdout], daemon=True).start()
    try:
        for _ in range(60):  # add records until it prints one: it has started by then
            assert appliance.run("down").returncode == 0
            with contextlib.suppress(queue.Empty):
                first = json.loads(printed.get(timeout=1))
                break
        assert first["seq"] > 3, "-n 0 -f prints only records written after it started"
    finally:
        follow.terminate()
        follow.wait(10)


def test_audit_verify_never_makes_the_key_it_verifies_with(appliance: Appliance) -> None:
    """A key made at verification would sign nothing in the log: verifying against it proves nothing."""
    key_file = appliance.home.secrets / "audit-signing-key.pem"
    for command in (("audit", "verify"), ("audit", "export-public-key")):
        refused = appliance.run(*command)
        assert refused.returncode == 1 and "no audit signing key" in refused.stderr, refused.stderr
        assert "--public-key" in refused.stderr
        assert not key_file.exists()
    signing_key(appliance.home)
    key_file.chmod(0o644)
    loose = appliance.run("audit", "verify")
    assert loose.returncode == 1 and "readable by others (mode 644)" in loose.stderr, loose.stderr
