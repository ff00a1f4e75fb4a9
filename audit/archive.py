"""Copy closed audit log files, and the checkpoints that vouch for them, to the artifact store;
fetch them back so `appliance audit verify --from-archive` checks the copies, not the host.

Layout in the store (every object written once, never replaced):
    audit/audit-000001.jsonl, ...          closed log files (the newest file is still open)
    audit/checkpoints-<seq>.jsonl          the checkpoints up to the last archived record
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from appliance.artifacts import ArtifactStore
from appliance.errors import ArtifactStoreError
from audit.writer import CHECKPOINTS, complete_lines, log_files

PREFIX = "audit/"
SNAPSHOT = "checkpoints-"


@dataclass
class Archived:
    location: str
    locked: bool
    files: list[str] = field(default_factory=list)
    checkpoints: str | None = None


def archive(directory: Path, store: ArtifactStore, *, retain_days: int, require_lock: bool) -> Archived:
    """Copy what is closed and not yet in the store; raise ArtifactStoreError if the store cannot
    keep copies write-once and `require_lock` says it must (before anything is copied)."""
    locked = store.write_once()
    if store.can_lock and require_lock and not locked:
        raise ArtifactStoreError(
            f"{store.location} does not keep Object Lock retention: archived audit files could be "
            "deleted or replaced", hint="use a bucket with Object Lock on a server that supports "
            "it, or set audit.archive_require_lock = false to accept plain copies")
    done = Archived(location=store.location, locked=locked)
    present = set(store.keys(PREFIX))
    closed = log_files(directory)[:-1]
    for path in closed:
        key = PREFIX + path.name
        if key not in present:
            store.put(key, path.read_bytes(), retain_days=retain_days)
            done.files.append(key)
    if not closed:
        return done
    last_seq = json.loads(closed[-1].read_bytes().splitlines()[-1])["seq"]
    source = directory / CHECKPOINTS
    written = complete_lines(source.read_bytes()) if source.exists() else []
    vouching = [line for line in written if json.loads(line)["seq"] <= last_seq]
    if vouching:
        key = f"{PREFIX}{SNAPSHOT}{json.loads(vouching[-1])['seq']:012d}.jsonl"
        if key not in present:
            store.put(key, b"\n".join(vouching) + b"\n", retain_days=retain_days)
            done.checkpoints = key
    return done


def fetch(store: ArtifactStore, into: Path) -> int:
    """Lay the archived log out in `into` as a log directory (the latest checkpoint snapshot as
    its checkpoints file); the number of log files fetched."""
    keys = store.keys(PREFIX)
    files = [key for key in keys if Path(key).name.startswith("audit-")]
    if not files:
        raise ArtifactStoreError(f"the archive at {store.location} holds no audit log files")
    for key in files:
        (into / Path(key).name).write_bytes(store.get(key))
    snapshots = [key for key in keys if Path(key).name.startswith(SNAPSHOT)]
    if snapshots:
        (into / CHECKPOINTS).write_bytes(store.get(max(snapshots)))
    return len(files)
