"""Child processes for tests that look at other processes."""

from __future__ import annotations

import subprocess
import sys


def python_sleeper(*argv: str, seconds: int = 60) -> subprocess.Popen[str]:
    """A Python process sleeping with `argv` on its command line, returned once it runs Python code.

    Popen returns once the child's exec has begun: the kernel fills in /proc/PID/cmdline a moment
    later, and on a loaded machine a look at it in between finds it empty."""
    child = subprocess.Popen([sys.executable, "-c", f"import time; print(flush=True); time.sleep({seconds})", *argv],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline() == "\n", "the sleeper did not start"
    return child
