"""Staging from a checkpoint in a real S3-compatible bucket (rclone serve s3): parallel ranged
reads, checked, and the staged result identical to staging the local copy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from installer.staging import MANIFEST
from tests.integration.conftest import client, s3_settings
from tests.support.appliances import Appliance, make_appliance
from tests.support.checkpoints import llama
from tests.support.plans import plan_for

APPLIANCE = str(Path(sys.executable).with_name("appliance"))


def test_stage_from_s3_matches_local(s3: str, tmp_path: Path) -> None:
    source = llama(tmp_path / "llama", layers=4, hidden=256, vocab=2048, files=3)
    bucket = client(s3)
    bucket.make_bucket("models")
    for path in source.iterdir():
        bucket.fput_object("models", f"llama/{path.name}", str(path))
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan_for(source, "2x1xL4-24GB", tp=1, pp=2).model_dump_json())
    for appliance in make_appliance(None, **s3_settings(s3)):
        def stage(what: str, out: Path, appliance: Appliance = appliance) -> subprocess.CompletedProcess[str]:
            return subprocess.run([APPLIANCE, "stage", what, "--plan", str(plan_file), "--out", str(out)],
                                  env=appliance.env, capture_output=True, text=True, timeout=300)

        local, remote = stage(str(source), tmp_path / "local"), stage("s3://models/llama", tmp_path / "remote")
        assert local.returncode == 0 and remote.returncode == 0, remote.stderr
        for host in ("node-0", "node-1"):
            hashes = [{n: e["sha256"]
                       for n, e in json.loads((tmp_path / out / host / MANIFEST).read_text())["files"].items()}
                      for out in ("local", "remote")]
            assert hashes[0] == hashes[1] and hashes[0], host
        fetched = tmp_path / "remote" / ".source"
        assert sorted(p.name for p in fetched.iterdir() if not p.name.startswith(".")) == sorted(
            p.name for p in source.iterdir())
        wrong = stage("s3://models/nothing-here", tmp_path / "wrong")
        assert wrong.returncode == 1 and "no config.json under this prefix" in wrong.stderr
