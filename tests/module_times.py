"""A pytest plugin: each test module's wall time (its tests' setup, call and teardown, so the
fixtures it starts count too), printed at the end of every run, slowest first, so CI's output
shows where the suite's time goes."""

from __future__ import annotations

from collections import defaultdict

import pytest

_seconds: defaultdict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _seconds:
        return
    terminalreporter.section("wall time per module")
    for module, seconds in sorted(_seconds.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{seconds:8.1f} s  {module}")
    terminalreporter.write_line(f"{sum(_seconds.values()):8.1f} s  in all")
