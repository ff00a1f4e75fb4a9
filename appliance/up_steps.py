"""The steps of `appliance up`, recorded as each is done, so that an `up` killed half-way is
finished by the next one rather than taken for a finished appliance.

An `up` holds a lock for as long as it runs (the kernel releases it when the process dies, killed
or not), and after each step replaces RUN/up-steps.json durably. Each step may be done again
safely: waiting for health, restoring CPU priority and provisioning all change nothing the second
time. "Already up" means supervisord runs and every step is recorded done.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from appliance.durable import read_small_file, replace_file
from appliance.errors import Conflict
from appliance.home import Home

# In order: supervisord started with every program; every program answered its health check;
# the programs started at a low CPU priority are back at normal; the provisioners ran (the realm
# and its bootstrap administrator).
STEPS = ("supervisord", "ready", "priority", "provisioned")
_MAX_BYTES = 4096


@dataclass(frozen=True)
class UpSteps:
    """The steps an `up` has done, in order."""

    done: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.done != STEPS[:len(self.done)]:
            raise ValueError(f"steps {list(self.done)} are not a start of {list(STEPS)}")

    @property
    def left(self) -> tuple[str, ...]:
        return STEPS[len(self.done):]

    def after(self, step: str) -> UpSteps:
        """These steps with `step`, the next one, done."""
        return UpSteps((*self.done, step))


def steps_file(home: Home) -> Path:
    return home.run / "up-steps.json"


def read_steps(home: Home) -> UpSteps | None:
    """The steps the last `up` recorded; None if none did (no `up` since the last `down`, or an
    older version's `up`, which recorded none) or the record cannot be read."""
    found = read_small_file(steps_file(home), _MAX_BYTES)
    if found is None:
        return None
    try:
        done = json.loads(found[0])["done"]
        if not isinstance(done, list) or not all(isinstance(step, str) for step in done):
            return None
        return UpSteps(tuple(done))
    except (ValueError, KeyError, TypeError):
        return None


def record_steps(home: Home, steps: UpSteps) -> UpSteps:
    """Replace the record with `steps` (0600, durably: a crash leaves this one or the one before)."""
    replace_file(steps_file(home), json.dumps({"done": list(steps.done)}).encode())
    return steps


def forget_steps(home: Home) -> None:
    """No `up` is under way or finished (after `down`, or a failed start stopped what it started)."""
    steps_file(home).unlink(missing_ok=True)


def _lock_file(home: Home) -> Path:
    return home.run / "up.lock"


@contextlib.contextmanager
def up_lock(home: Home) -> Iterator[None]:
    """Held while an `up` runs: a second one at the same time is refused, never run beside it."""
    fd = os.open(_lock_file(home), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Conflict("another `appliance up` is starting the appliance now",
                           hint="wait for it to finish, then run `appliance status`") from None
        yield
    finally:
        os.close(fd)


def up_running(home: Home) -> bool:
    """Whether an `up` holds the lock now."""
    try:
        fd = os.open(_lock_file(home), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
