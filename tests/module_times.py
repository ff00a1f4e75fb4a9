"""A pytest plugin: each test module's wall time (its tests' setup, call and teardown, so the
fixtures it starts count too), printed at the end of every run, slowest first, so CI's output
shows where the suite's time goes: with when it ran (minutes from the first test's start) and how
long of it the module waited for another to release a shared resource (tests/integration/conftest.py's
module locks, which record their waits in the run's shared directory)."""

from __future__ import annotations

import json
import os
from collections import defaultdict

import pytest

from tests.support.shared import SHARED_ENV, WAITS

_seconds: defaultdict[str, float] = defaultdict(float)
_span: dict[str, tuple[float, float]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    module = report.nodeid.split("::", 1)[0]
    _seconds[module] += report.duration
    if not report.start:  # a crashed worker's report carries no times
        return
    first, last = _span.get(module, (report.start, report.stop))
    _span[module] = (min(first, report.start), max(last, report.stop))


def waits() -> dict[str, float]:
    """Seconds each module waited for its locks, as the workers recorded them."""
    path = os.path.join(os.environ.get(SHARED_ENV, ""), WAITS)
    waited: defaultdict[str, float] = defaultdict(float)
    if os.environ.get(SHARED_ENV) and os.path.exists(path):
        with open(path) as lines:
            for line in lines:
                try:
                    entry = json.loads(line)
                except ValueError:  # a line cut short (a worker killed as it wrote): the report goes on
                    continue
                waited[entry["module"]] += entry["waited_s"]
    return waited


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _seconds:
        return
    waited, origin = waits(), min((first for first, _ in _span.values()), default=0.0)
    terminalreporter.section("wall time per module")
    terminalreporter.write_line("    wall  waited    from      to  module")
    for module, seconds in sorted(_seconds.items(), key=lambda item: -item[1]):
        first, last = _span.get(module, (origin, origin))
        terminalreporter.write_line(f"{seconds:8.1f} {waited.get(module, 0.0):7.1f} {(first - origin) / 60:7.1f} "
                                    f"{(last - origin) / 60:7.1f}  {module}")
    terminalreporter.write_line(f"{sum(_seconds.values()):8.1f} {sum(waited.values()):7.1f}  in all (seconds; "
                                "from and to in minutes)")
