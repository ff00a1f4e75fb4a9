"""Writes a run's trajectories to the artifact store (the format: appliance.trajectories). A
segment's attempts are chosen (sealed, in the run's store) before it is put, so a run killed between
the two puts the same bytes under the same key when it resumes."""

from __future__ import annotations

import hashlib

from appliance.artifacts import ArtifactStore
from appliance.home import Home
from appliance.rl.runs import Run, record_manifest_digest
from appliance.rl.tasks import Task
from appliance.trajectories import Manifest, Segment, manifest_key, segment_key
from finetune.rl.store import RunStore


class TrajectoryWriter:
    def __init__(self, store: RunStore, artifacts: ArtifactStore, home: Home, run: Run, tasks: list[Task],
                 segment_attempts: int) -> None:
        self.store, self.artifacts, self.home, self.run, self.tasks = store, artifacts, home, run, tasks
        self.segment_attempts = segment_attempts

    def flush(self, at_least: int | None = None) -> None:
        """Seal a segment once `segment_attempts` attempts wait for one, and put what is sealed."""
        self.store.seal_segment(self.segment_attempts if at_least is None else at_least)
        for number in self.store.unput_segments():
            data = self.store.segment_lines(number)
            digest = hashlib.sha256(data).hexdigest()
            key = segment_key(self.run.id, digest)
            self.artifacts.put(key, data, retain_days=0)
            self.store.segment_put(number, key, digest)

    def finish(self) -> str:
        """Put the last segment and the manifest; the manifest's key and digest."""
        self.flush(at_least=1)
        segments = [Segment(key=str(s["key"]), sha256=str(s["sha256"]), attempts=int(str(s["attempts"])))
                    for s in self.store.segments()]
        manifest = Manifest(run=self.run.id, spec=self.run.spec.model_dump(), tasks=[t.id for t in self.tasks],
                            attempts=sum(s.attempts for s in segments), segments=segments)
        data = manifest.model_dump_json(indent=1).encode()
        self.artifacts.put(manifest_key(self.run.id), data, retain_days=0)
        digest = hashlib.sha256(data).hexdigest()
        record_manifest_digest(self.home, self.run.id, digest)
        return f"{manifest_key(self.run.id)} (sha256 {digest})"
