"""Registering a trained adapter: its files go to the artifact store as the next version of its
name, its record to the registry (appliance.adapters)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from appliance import adapters
from appliance.adapters import AdapterRecord
from appliance.artifacts import ArtifactStore
from appliance.home import Home

PREFIX = "adapters/"


def register(home: Home, store: ArtifactStore, adapter_dir: Path, **fields: object) -> AdapterRecord:
    """Copy the adapter's files to the store as the next version of its name and record it."""
    with adapters.updating(home) as registry:
        name = str(fields["name"])
        version = 1 + max((r.version for r in registry.versions(name)), default=0)
        artifact = f"{PREFIX}{name}/v{version}/"
        files = {}
        for path in sorted(adapter_dir.iterdir()):
            if path.is_file():
                data = path.read_bytes()
                store.put(artifact + path.name, data, retain_days=0)
                files[path.name] = hashlib.sha256(data).hexdigest()
        record = AdapterRecord(**{**fields, "version": version, "artifact": artifact, "files": files})
        registry.adapters.append(record)
    return record
