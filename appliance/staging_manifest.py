"""The staging manifest (`staging-manifest.json` in a staged directory): one model for both
formats, written by `appliance stage` after every finished file and read by `stage --verify`,
the admin API and the TUI.

- `subset`: one entry per safetensors file, its SHA-256 and where each tensor came from.
- `sharded`: one entry per tensor-parallel rank (`rank-N`), each listing its part files with the
  SHA-256 of the header and of every tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from appliance.durable import replace_file
from appliance.errors import StateError
from appliance.records import STAGING_MANIFEST


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TensorSource(_Strict):
    """Where a tensor of a subset file lies, there and in the source checkpoint."""

    dtype: str
    shape: list[int]
    source: str  # the source file's name
    source_offsets: tuple[int, int]
    offsets: tuple[int, int]  # in the staged file's data section


class SubsetFile(_Strict):
    sha256: str
    bytes: int
    tensors: dict[str, TensorSource]


class ShardPart(_Strict):
    bytes: int
    header_sha256: str
    tensor_sha256: dict[str, str]


class RankFiles(_Strict):
    files: dict[str, ShardPart]


class StagingManifest(_Strict):
    source: str
    config_sha256: str
    format: Literal["subset", "sharded"] = "subset"
    host: str
    layers: tuple[int, int]
    experts: tuple[int, int] | None = None
    complete: bool = False
    files: dict[str, SubsetFile] | dict[str, RankFiles] = {}

    @model_validator(mode="after")
    def _files_match_format(self) -> StagingManifest:
        expected = RankFiles if self.format == "sharded" else SubsetFile
        if any(not isinstance(entry, expected) for entry in self.files.values()):
            raise ValueError(f"files are not those of a {self.format} staging")
        return self

    @classmethod
    def load(cls, directory: Path) -> StagingManifest:
        """The manifest in `directory`; StateError naming the file if it is unreadable."""
        path = directory / STAGING_MANIFEST
        try:
            return cls.model_validate_json(path.read_bytes())
        except (OSError, ValidationError) as exc:
            raise StateError(f"{path}: not a readable staging manifest: {exc}") from exc

    def save(self, directory: Path) -> None:
        replace_file(directory / STAGING_MANIFEST, self.model_dump_json(indent=1).encode())

    def staged_files(self) -> dict[str, SubsetFile | ShardPart]:
        """Every file staged so far, by name (a sharded staging's parts of every rank)."""
        found: dict[str, SubsetFile | ShardPart] = {}
        for name, entry in self.files.items():
            if isinstance(entry, RankFiles):
                found.update(entry.files)
            else:
                found[name] = entry
        return found

    def total_bytes(self) -> int:
        return sum(entry.bytes for entry in self.staged_files().values())
