"""Rich progress bars for long steps: bytes with speed and ETA, or counted steps (or evaluations, attempts...)."""

from __future__ import annotations

from rich.console import Console
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
    """Bytes and speed for byte-sized tasks (the default), "n/m UNIT" for a counted task
    (unit="steps", "evaluations", ...); nothing for a counted task with no total yet."""

    _bytes = DownloadColumn()
    _speed = TransferSpeedColumn()

    def render(self, task: Task) -> Text:
        unit = task.fields.get("unit")
        if unit is None:
            return Text.assemble(self._bytes.render(task), " ", self._speed.render(task))
        return Text(f"{task.completed:.0f}/{task.total:.0f} {unit}" if task.total is not None else "")


def byte_progress(*, stderr: bool = False) -> Progress:
    """A progress display for downloads, unpacking, hashing and conversion steps (on standard
    error with `stderr`: where standard output is the command's result)."""
    return Progress(TextColumn("{task.description}"), BarColumn(), _AmountColumn(),
                    TimeRemainingColumn(), console=Console(stderr=True) if stderr else None)
