"""Reading the audit log back: records in order, filtered by time and user."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from audit.writer import complete_lines, log_files


def read_records(directory: Path, *, since: str | None = None, until: str | None = None,
                 user: str | None = None) -> Iterator[dict]:
    """Records in sequence order; `since` inclusive and `until` exclusive (UTC ISO 8601)."""
    files = log_files(directory)
    for path in files:
        data = path.read_bytes()
        for raw in complete_lines(data) if path == files[-1] else data.splitlines():
            record = json.loads(raw)
            if since is not None and record["time"] < since:
                continue
            if until is not None and record["time"] >= until:
                continue
            if user is not None and record.get("username") != user:
                continue
            yield record
