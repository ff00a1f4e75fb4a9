"""Trajectories in the artifact store (local or S3): a run's attempts (appliance.rl.attempts.Attempt) as JSONL
segments, each stored under its own SHA-256 and never written again, and, when the run ends, a
manifest naming every segment with its digest and count (finetune.rl.trajectories writes them):

    trajectories/run-<id>/segments/<sha256>.jsonl
    trajectories/run-<id>/manifest.json     {"run", "spec", "tasks", "attempts", "segments": [...]}

Reading them back checks the manifest against the digest its run recorded when it wrote it (so a
manifest rewritten in the store, or another appliance's run of the same number, is refused), and
every segment against the manifest.
"""

from __future__ import annotations

import hashlib
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from appliance.artifacts import ArtifactStore
from appliance.errors import IntegrityError, NotFound
from appliance.home import Home
from appliance.rl import runs
from appliance.rl.attempts import Attempt

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


def read_run(artifacts: ArtifactStore, home: Home, run_id: int) -> tuple[Manifest, list[Attempt]]:
    """A run of this appliance's trajectories (NotFound for a run that never was), verified."""
    runs.get(home, run_id)
    return read(artifacts, run_id, runs.manifest_digest(home, run_id))


def read(artifacts: ArtifactStore, run_id: int, manifest_sha256: str | None) -> tuple[Manifest, list[Attempt]]:
    """A run's manifest, checked against the digest its run recorded (appliance.rl.runs.manifest_digest),
    and every attempt in its segments, each checked against the manifest; IntegrityError names the
    first thing that is not what was written."""
    if manifest_sha256 is None:
        raise NotFound(f"run {run_id} has not written its trajectories (it has not ended)")
    key = manifest_key(run_id)
    data = artifacts.get(key)
    if (found := hashlib.sha256(data).hexdigest()) != manifest_sha256:
        raise IntegrityError(f"trajectory manifest {key} in {artifacts.location} is not run {run_id}'s: it hashes to "
                             f"{found[:16]}..., the run wrote {manifest_sha256[:16]}...")
    manifest = _valid(Manifest, data, key)
    attempts: list[Attempt] = []
    for segment in manifest.segments:
        if segment.key != segment_key(run_id, segment.sha256):
            raise IntegrityError(f"trajectory manifest {key} names {segment.key!r}, not a segment of run {run_id}")
        data = artifacts.get(segment.key)
        found = hashlib.sha256(data).hexdigest()
        if found != segment.sha256:
            raise IntegrityError(f"trajectory segment {segment.key} was changed: it hashes to {found[:16]}..., "
                                 f"the manifest says {segment.sha256[:16]}...")
        lines = [_valid(Attempt, line, segment.key) for line in data.splitlines()]
        if len(lines) != segment.attempts:
            raise IntegrityError(f"trajectory segment {segment.key} holds {len(lines)} attempts, "
                                 f"the manifest says {segment.attempts}")
        attempts += lines
    return manifest, attempts


Record = TypeVar("Record", Manifest, Attempt)


def _valid(model: type[Record], data: bytes, key: str) -> Record:
    try:
        return model.model_validate_json(data)
    except ValidationError as exc:
        raise IntegrityError(f"{key}: not a trajectory {model.__name__.lower()}: {exc.errors()[0]['msg']}") from exc
