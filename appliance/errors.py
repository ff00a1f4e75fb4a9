"""Errors the appliance reports to an operator.

ApplianceError                 root: the CLI catches only this and prints one line
 +-- SettingsError             settings file or environment override is invalid
 +-- StateError                the state directory or a secret is unusable
 +-- SupervisorError           supervisord cannot be started or reached
 +-- StartError                a supervised program failed to start (carries its log path)
 +-- IntegrityError            a stored artifact no longer matches the digest recorded for it
"""

from __future__ import annotations

from pathlib import Path


class ApplianceError(Exception):
    """An error with a one-line message and, optionally, what to do next."""

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


class SettingsError(ApplianceError):
    """The settings file or an environment override is invalid."""


class StateError(ApplianceError):
    """The state directory or a secret in it is unusable."""


class SupervisorError(ApplianceError):
    """supervisord cannot be started, reached or stopped."""


class StartError(ApplianceError):
    """A supervised program did not come up."""


class IntegrityError(ApplianceError):
    """A stored artifact (dataset, adapter version) no longer matches its recorded digest."""
