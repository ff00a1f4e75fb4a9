"""Changes made through the CLI on this host (not through the admin API, which records its own)
are announced to the recorders that packages register under the `appliance.change_recorders`
entry points (the audit log is one), so the core needs no import of theirs.

A change names its object (`Target`: the user, dataset, adapter, batch, job or key it acted on),
noted by the command while it runs (`note_target`), and its outcome: `allowed`, `invalid` (the
caller's fault: bad input, no such object, a conflict) or `error` (the appliance's). A service of
the appliance acting on its own (the batch worker, the training worker) names itself as `actor`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from appliance.errors import ApplianceError, Conflict, Invalid, NotFound
from appliance.home import Home

RECORDERS_GROUP = "appliance.change_recorders"
Command = TypeVar("Command", bound=Callable[..., Any])


Outcome = Literal["allowed", "denied", "invalid", "error"]


class Target(BaseModel):
    """The object an action acted on, as the audit log names it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str = Field(description="user, dataset, adapter, batch, job, key, host, service, pool, rl_run...")
    name: str
    version: int | str | None = Field(None, description="An adapter's version number, a dataset's sha256.")
    roles: list[str] | None = Field(None, description="Roles granted, revoked or held by a user acted on.")


@dataclass(frozen=True)
class Change:
    action: str  # e.g. appliance.up, model.prepare
    outcome: Outcome
    exit_status: int
    target: Target | None = None
    detail: str | None = None  # what it did, in words
    error: str | None = None  # why it failed
    reason: str | None = None  # the failure's code (appliance.errors)
    actor: str | None = None  # a service of the appliance acting on its own: "batch-worker"


_noted: ContextVar[Target | None] = ContextVar("noted_target", default=None)


def note_target(kind: str, name: str, *, version: int | str | None = None, roles: list[str] | None = None) -> None:
    """Name the object the running command acts on (called as soon as it is known, so a failure
    names it too)."""
    _noted.set(Target(kind=kind, name=name, version=version, roles=roles))


def failure_outcome(exc: BaseException) -> Outcome:
    """`invalid` for what the caller got wrong, `error` for the appliance's own failures."""
    return "invalid" if isinstance(exc, (Invalid, NotFound, Conflict)) else "error"


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
            noted = _noted.set(None)
            try:
                try:
                    result = command(*args, **kwargs)
                except ApplianceError as exc:
                    announce(Change(action, failure_outcome(exc), 1, _noted.get(), error=exc.message,
                                           reason=exc.code))
                    raise
                except (Exception, KeyboardInterrupt) as exc:
                    announce(Change(action, "error", 1, _noted.get(), error=f"ended by {type(exc).__name__}",
                                           reason=type(exc).__name__))
                    raise
                announce(Change(action, "allowed", 0, _noted.get(), detail() if detail else None))
                return result
            finally:
                _noted.reset(noted)

        return run  # type: ignore[return-value]

    return decorate
