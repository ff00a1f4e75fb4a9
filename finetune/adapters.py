"""Registering a trained adapter: its files go to the artifact store as the next version of its
name, its record to the registry (appliance.adapters)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from appliance import adapters
from appliance.adapters import AdapterMetrics, AdapterRecord, AdapterState
from appliance.artifacts import ArtifactStore
from appliance.errors import IntegrityError
from appliance.home import Home
from appliance.jobs import Hyperparameters

PREFIX = "adapters/"


def register(home: Home, store: ArtifactStore, adapter_dir: Path, *, name: str, base_model: str,
             base_config_sha256: str, dataset: str, dataset_sha256: str, hyperparameters: Hyperparameters,
             metrics: AdapterMetrics, state: AdapterState) -> AdapterRecord:
    """Copy the adapter's files to the store as the next version of its name and record it."""
    # Made by the sandboxed trainer: a link may point at anything the worker can read.
    paths = [adapter_dir, *sorted(adapter_dir.iterdir())]
    if links := [path for path in paths if path.is_symlink()]:
        raise IntegrityError(f"{links[0]}: the trained adapter holds a symbolic link; refused", hint="train it again")
    with adapters.updating(home) as registry:
        version = 1 + max((r.version for r in registry.versions(name)), default=0)
        artifact = f"{PREFIX}{name}/v{version}/"
        files = {}
        for path in paths[1:]:
            if path.is_file():
                data = path.read_bytes()
                store.put(artifact + path.name, data, retain_days=0)
                files[path.name] = hashlib.sha256(data).hexdigest()
        record = AdapterRecord(name=name, version=version, base_model=base_model,
                               base_config_sha256=base_config_sha256, dataset=dataset, dataset_sha256=dataset_sha256,
                               hyperparameters=hyperparameters, metrics=metrics, artifact=artifact, files=files,
                               state=state)
        registry.adapters.append(record)
    return record
