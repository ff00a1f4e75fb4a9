"""Trajectories in the artifact store (local or S3): a run's attempts (appliance.rl.Attempt) as JSONL
segments, each stored under its own SHA-256 and never written again, and, when the run ends, a
manifest naming every segment with its digest and count (finetune.rl.trajectories writes them):

    trajectories/run-<id>/segments/<sha256>.jsonl
    trajectories/run-<id>/manifest.json     {"run", "spec", "tasks", "attempts", "segments": [...]}

Reading them back checks every segment against its digest and count.
"""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel

from appliance.artifacts import ArtifactStore
from appliance.errors import IntegrityError, NotFound
from appliance.rl import Attempt

PREFIX = "trajectories/"


class Segment(BaseModel):
    key: str
    sha256: str
    attempts: int


class Manifest(BaseModel):
    run: int
    spec: dict[str, object]
    tasks: list[str]
    attempts: int
    segments: list[Segment]


def run_prefix(run_id: int) -> str:
    return f"{PREFIX}run-{run_id}/"


def manifest_key(run_id: int) -> str:
    return f"{run_prefix(run_id)}manifest.json"


def segment_key(run_id: int, sha256: str) -> str:
    return f"{run_prefix(run_id)}segments/{sha256}.jsonl"


def read(artifacts: ArtifactStore, run_id: int) -> tuple[Manifest, list[Attempt]]:
    """A run's manifest and every attempt in its segments, each segment checked against its digest;
    IntegrityError names the first that is not what the manifest says."""
    key = manifest_key(run_id)
    if key not in artifacts.keys(run_prefix(run_id)):
        raise NotFound(f"run {run_id} has no trajectory manifest in {artifacts.location}",
                       hint="a run writes it when it ends")
    manifest = Manifest.model_validate_json(artifacts.get(key))
    attempts: list[Attempt] = []
    for segment in manifest.segments:
        data = artifacts.get(segment.key)
        found = hashlib.sha256(data).hexdigest()
        if found != segment.sha256 or segment.key != segment_key(run_id, found):
            raise IntegrityError(f"trajectory segment {segment.key} was changed: it hashes to {found[:16]}..., "
                                 f"the manifest says {segment.sha256[:16]}...")
        lines = [Attempt.model_validate(json.loads(line)) for line in data.splitlines()]
        if len(lines) != segment.attempts:
            raise IntegrityError(f"trajectory segment {segment.key} holds {len(lines)} attempts, "
                                 f"the manifest says {segment.attempts}")
        attempts += lines
    return manifest, attempts
