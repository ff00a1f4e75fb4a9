"""Rich progress bars for long installer steps: bytes with speed and ETA, or counted steps."""

from __future__ import annotations

from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.text import Text


class _AmountColumn(ProgressColumn):
    """Bytes and speed for byte-sized tasks (the default), "n/m steps" for unit="steps"."""

    _bytes = DownloadColumn()
    _speed = TransferSpeedColumn()

    def render(self, task: Task) -> Text:
        if task.fields.get("unit") == "steps":
            return Text(f"{task.completed:.0f}/{task.total or 0:.0f} steps")
        return Text.assemble(self._bytes.render(task), " ", self._speed.render(task))


def byte_progress() -> Progress:
    """A progress display for downloads, unpacking, hashing and conversion steps."""
    return Progress(TextColumn("{task.description}"), BarColumn(), _AmountColumn(),
                    TimeRemainingColumn())
