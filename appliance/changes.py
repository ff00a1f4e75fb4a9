"""Changes made through the CLI on this host (not through the admin API, which records its own)
are announced to the recorders that packages register under the `appliance.change_recorders`
entry points (the audit log is one), so the core needs no import of theirs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Literal, TypeVar

from appliance.errors import ApplianceError
from appliance.home import Home

RECORDERS_GROUP = "appliance.change_recorders"
Command = TypeVar("Command", bound=Callable[..., Any])


@dataclass(frozen=True)
class Change:
    action: str  # e.g. appliance.up, model.prepare
    outcome: Literal["allowed", "error"]
    exit_status: int
    detail: str | None = None  # what it acted on, or why it failed


def announce(change: Change) -> None:
    """Hand `change` to every recorder; a recorder that cannot record raises ApplianceError."""
    home = Home.from_env()
    if not home.root.is_dir():
        return  # no appliance here yet: nothing was changed
    for entry in entry_points(group=RECORDERS_GROUP):
        entry.load()(home, change)


def records_change(action: str, detail: Callable[[], str] | None = None) -> Callable[[Command], Command]:
    """Decorate a CLI command that changes the appliance: its outcome is recorded either way,
    with `detail()` after a success."""

    def decorate(command: Command) -> Command:
        @functools.wraps(command)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                result = command(*args, **kwargs)
            except ApplianceError as exc:
                announce(Change(action, "error", 1, exc.message))
                raise
            except (Exception, KeyboardInterrupt) as exc:
                announce(Change(action, "error", 1, f"ended by {type(exc).__name__}"))
                raise
            announce(Change(action, "allowed", 0, detail() if detail else None))
            return result

        return run  # type: ignore[return-value]

    return decorate
