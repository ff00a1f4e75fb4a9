"""Replacing a file durably: the new bytes, the mode asked for, nothing left beside it."""

from __future__ import annotations

import stat
from pathlib import Path

from appliance.durable import replace_file


def test_replace_file_writes_the_new_bytes_with_its_mode_and_leaves_nothing_beside(tmp_path: Path) -> None:
    path = tmp_path / "adapters.json"
    path.write_text("old")
    replace_file(path, b"new" * 100_000)
    assert path.read_bytes() == b"new" * 100_000
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    replace_file(path, b"sealed", mode=0o400)
    assert path.read_bytes() == b"sealed" and stat.S_IMODE(path.stat().st_mode) == 0o400
    assert [p.name for p in tmp_path.iterdir()] == ["adapters.json"]
