"""Errors the appliance reports to an operator.

ApplianceError                 root: the CLI catches only this and prints one line
 +-- Invalid                   what was asked for is malformed or not allowed (HTTP 400)
 |    +-- SettingsError        settings file or environment override is invalid
 +-- NotFound                  what was named does not exist (HTTP 404)
 +-- Conflict                  it exists but is in a state that forbids the change (HTTP 409)
 |    +-- IllegalTransition    a job or adapter asked to move to a state its own does not lead to
 |    +-- IntegrityError       a stored artifact no longer matches the digest recorded for it
 +-- QuotaExceeded             the caller has used what a quota allows; retry later (HTTP 429)
 +-- Unavailable               something it depends on cannot be used now; retry later (HTTP 503)
 |    +-- StateError           the state directory, a state file or a secret is unusable
 |    +-- SupervisorError      supervisord cannot be started or reached
 +-- StartError                a supervised program failed to start (carries its log path)

Each class has a `code` (the machine-readable name transports use); the gateway maps the five
families to HTTP once (serve.errors.from_core).
"""

from __future__ import annotations

from pathlib import Path


class ApplianceError(Exception):
    """An error with a one-line message and, optionally, what to do next."""

    code = "appliance_error"

    def __init__(self, message: str, *, hint: str | None = None, log: Path | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.log = log

    def one_line(self) -> str:
        """The message, the log to read and the hint, on one line."""
        parts = [self.message]
        if self.log is not None:
            parts.append(f"log: {self.log}")
        if self.hint:
            parts.append(self.hint)
        return "; ".join(parts)


class Invalid(ApplianceError):
    """What was asked for is malformed or not allowed."""

    code = "invalid"


class NotFound(ApplianceError):
    """What was named does not exist."""

    code = "not_found"


class Conflict(ApplianceError):
    """What was named exists, but its state forbids the change."""

    code = "conflict"


class QuotaExceeded(ApplianceError):
    """The caller has used what a quota allows; it may retry once some is freed."""

    code = "quota_exceeded"


class Unavailable(ApplianceError):
    """Something the operation depends on cannot be used now."""

    code = "unavailable"


class ArtifactStoreError(Unavailable):
    """The artifact store (appliance.artifacts, appliance.s3_store) could not be read or written."""


class SettingsError(Invalid):
    """The settings file or an environment override is invalid."""

    code = "settings"


class StateError(Unavailable):
    """The state directory, a file in it or a secret is unusable."""

    code = "state"


class SupervisorError(Unavailable):
    """supervisord cannot be started, reached or stopped."""

    code = "supervisor"


class StartError(ApplianceError):
    """A supervised program did not come up."""


class IllegalTransition(Conflict):
    """A lifecycle (training job, adapter version) asked for a move its state machine forbids."""

    code = "illegal_transition"


class IntegrityError(Conflict):
    """A stored artifact (dataset, adapter version) no longer matches its recorded digest."""

    code = "artifact_integrity"
