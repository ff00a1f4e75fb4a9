"""What the workers of one test run share (the suite runs on pytest-xdist workers): a directory
that the run's main process makes and removes, and locks in it that let a module have a shared
resource to itself."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# Set by the run's main process before it starts its workers, which inherit it.
SHARED_ENV = "TESTS_SHARED_DIR"
# In it: how long each module waited for its locks, a JSON line each (tests/module_times.py reports them).
WAITS = "lock-waits.jsonl"


def shared_dir() -> Path:
    """The directory every worker of this run shares."""
    return Path(os.environ[SHARED_ENV])


@contextmanager
def locked(name: str, exclusive: bool) -> Iterator[None]:
    """Holds the run-wide lock `name`: exclusive, or shared with other shared holders."""
    with (shared_dir() / f"{name}.lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
