"""The adapter registry: versioned adapter records (DESIGN.md) with their files in the artifact
store and the list in the state dir."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from appliance.artifacts import ArtifactStore
from appliance.home import Home

PREFIX = "adapters/"


class AdapterRecord(BaseModel):
    name: str
    version: int
    base_model: str
    base_config_sha256: str
    dataset: str
    dataset_sha256: str
    hyperparameters: dict
    metrics: dict
    artifact: str  # the key prefix in the artifact store
    state: Literal["registered", "failed-gate", "deployed", "canary", "retired"]
    created: str


def registry_path(home: Home) -> Path:
    return home.root / "adapters.json"


def load(home: Home) -> list[AdapterRecord]:
    path = registry_path(home)
    return [AdapterRecord.model_validate(r) for r in json.loads(path.read_text())] if path.exists() else []


def register(home: Home, store: ArtifactStore, adapter_dir: Path, **fields: object) -> AdapterRecord:
    """Copy the adapter's files to the store as the next version of its name and record it."""
    records = load(home)
    name = str(fields["name"])
    version = 1 + max((r.version for r in records if r.name == name), default=0)
    artifact = f"{PREFIX}{name}/v{version}/"
    for path in sorted(adapter_dir.iterdir()):
        if path.is_file():
            store.put(artifact + path.name, path.read_bytes(), retain_days=0)
    record = AdapterRecord(**{**fields, "version": version, "artifact": artifact,
                              "created": datetime.now(UTC).isoformat(timespec="seconds")})
    path = registry_path(home)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps([r.model_dump() for r in [*records, record]], indent=1))
    os.replace(partial, path)
    return record
