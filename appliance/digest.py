"""SHA-256 of files, read in chunks, optionally shown on a progress bar."""

from __future__ import annotations

import hashlib
from pathlib import Path

from rich.progress import Progress

CHUNK = 1 << 20


def sha256_file(path: Path, progress: Progress | None = None) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    task = progress.add_task(f"sha256 {path.name}", total=path.stat().st_size) if progress else None
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
            if progress is not None and task is not None:
                progress.advance(task, len(chunk))
    return digest.hexdigest()
