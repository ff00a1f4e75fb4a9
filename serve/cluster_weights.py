"""The weights a worker of a pool spanning hosts takes from the head: which directory holds its
ranks' weights, their listing (each file with its size and SHA-256), and the files themselves,
served only while they are plain files of that listing."""

from __future__ import annotations

from pathlib import Path

from appliance.errors import Invalid
from appliance.home import Home
from appliance.hosts import Digests, WeightFile, weight_files
from appliance.model_refs import model_dir
from appliance.records import STAGING_MANIFEST
from appliance.staging_manifest import StagingManifest
from serve.engine import SpanningPool


def weights_dir(span: SpanningPool, home: Home, host: str) -> Path:
    """What a worker's ranks load: where the pool serves a subset staged for this plan
    (`appliance stage`: OUT/<host>/ per host), the worker's own subset beside the head's;
    else the pool's whole checkpoint."""
    directory = model_dir(span.pool, home)
    if not (directory / STAGING_MANIFEST).exists():
        return directory
    own = directory.parent / host
    manifest = StagingManifest.load(own) if (own / STAGING_MANIFEST).exists() else None
    if manifest is None or manifest.host != host or not manifest.complete:
        raise Invalid(f"pool {span.pool.name} serves a staged subset ({directory}), but {own} holds no complete "
                      f"subset staged for {host}", hint=f"appliance stage ... --plan PLAN --out {directory.parent} "
                      f"--host {host}")
    return own


class WeightService:
    """Lists and hands out the weights of each worker's ranks, remembering digests of files
    that did not change (a join lists them, and so does every file a worker then fetches)."""

    def __init__(self, home: Home) -> None:
        self._home = home
        self._digests: Digests = {}

    def listing(self, span: SpanningPool, host: str) -> list[WeightFile]:
        """The files `host`'s ranks of `span` load; ApplianceError when there are none to take."""
        return weight_files(weights_dir(span, self._home, host), self._digests)

    def file(self, span: SpanningPool, host: str, path: str) -> Path | None:
        """Where `path` of `host`'s weights is, if the listing holds it and it is still a plain
        file inside their directory; ApplianceError when the weights cannot be listed."""
        directory = weights_dir(span, self._home, host)
        listed = {f.path for f in weight_files(directory, self._digests)}
        target = directory / path
        # Listed a moment ago; served only if it is still a plain file inside the directory.
        if path not in listed or target.is_symlink() or not target.resolve().is_relative_to(directory.resolve()):
            return None
        return target
