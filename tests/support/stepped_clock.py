"""A wall clock stepped by some seconds, as NTP or an operator may step a host's: `time.time` and
psutil's boot time (which the kernel derives from the wall clock, and which psutil adds to every
process's start) moved by that much in this process.

`python -m tests.support.stepped_clock SECONDS ARGS...` runs the `appliance` command under it.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from unittest import mock

from psutil import _pslinux


@contextlib.contextmanager
def stepped_clock(seconds: float) -> Iterator[None]:
    real_time = time.time
    real_boot = _pslinux.boot_time  # what psutil.boot_time and Process.create_time ask (the appliance is Linux-only)
    with mock.patch.object(time, "time", lambda: real_time() + seconds), \
            mock.patch.object(_pslinux, "boot_time", lambda: real_boot() + seconds):
        yield


def main(argv: list[str]) -> None:
    seconds, args = float(argv[0]), argv[1:]
    with stepped_clock(seconds):
        from appliance.cli import main as appliance

        sys.argv = ["appliance", *args]
        appliance()


if __name__ == "__main__":
    main(sys.argv[1:])
