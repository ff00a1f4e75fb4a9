"""Waiting for an event, not for a time: a condition polled until it holds.

A test that sleeps a fixed time guesses how long the event takes, and a loaded host makes the
guess wrong. `until` asks instead; its deadline only bounds a hang (a bug), so it is generous and
never what a test proves: a test asserts the event or the order of events, not how fast they came.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def until(check: Callable[[], T | None], what: str | Callable[[], str], timeout_s: float = 60,
          interval_s: float = 0.05) -> T:
    """`check()`'s first truthy answer, asked every `interval_s`; fails naming `what` (or what it
    returns, for a message that shows the state) if none came within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what if isinstance(what, str) else what()}")
        time.sleep(interval_s)
    return found
