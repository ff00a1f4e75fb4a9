"""Loaded by any Python process started with this folder on PYTHONPATH (bench/gateway_ab.py
--probe-stalls does so for the gateway under test): finds what stalls its event loop.

- every garbage collection of generation 2 is timed, with when it ran (seconds since the process
  started) and how many objects were frozen out of it (gc.freeze) at the time;
- a thread pings the main thread's event loop every millisecond; when a ping waits longer than
  STALL_MS, the main thread's stack is sampled while it still waits, so the code holding the loop
  is named.

Every REPORT_S (and at exit) the findings go to $STALL_PROBE_OUT (JSON; uvicorn ends by
raising the signal it caught, so a process it runs never reaches its exit handlers):
collections (count, total and max ms) and the stalls grouped by the innermost frames of the
project's code seen in their samples.
"""

from __future__ import annotations

import atexit
import collections
import gc
import json
import os
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio

STALL_MS = float(os.environ.get("STALL_PROBE_MS", "3"))
REPORT_S = 2.0
OUT = os.environ.get("STALL_PROBE_OUT")
_gc: list[tuple[float, float, int]] = []  # (at, ms, frozen objects)
_START = time.perf_counter()
_gc_started = [0.0]
_stalls: collections.Counter[str] = collections.Counter()
_stall_ms: collections.defaultdict[str, float] = collections.defaultdict(float)


def _on_gc(phase: str, info: dict[str, int]) -> None:
    if info["generation"] != 2:
        return
    if phase == "start":
        _gc_started[0] = time.perf_counter()
    else:
        now = time.perf_counter()
        _gc.append((round(now - _START, 1), round((now - _gc_started[0]) * 1000, 1), gc.get_freeze_count()))


def _where(frame: object) -> str:
    """The innermost frames of the stack that are the project's, or else the innermost ones."""
    stack = traceback.extract_stack(frame)  # type: ignore[arg-type]
    ours = [f for f in stack if "/site-packages/" not in f.filename and "/lib/python" not in f.filename]
    chosen = (ours or stack)[-3:]
    if stack and stack[-1] not in chosen:
        chosen.append(stack[-1])
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(chosen))


def _watch() -> None:
    main = threading.main_thread().ident
    loop = None
    while loop is None:
        time.sleep(0.5)
        loop = _running_loop()
    reported = time.monotonic()
    while True:
        if time.monotonic() - reported > REPORT_S:
            _report()
            reported = time.monotonic()
        done = threading.Event()
        sent = time.perf_counter()
        try:
            loop.call_soon_threadsafe(done.set)
        except RuntimeError:
            return  # the loop closed
        if not done.wait(STALL_MS / 1000):
            where = _where(sys._current_frames().get(main) if main is not None else None)
            done.wait(10)
            waited = (time.perf_counter() - sent) * 1000
            _stalls[where] += 1
            _stall_ms[where] += waited
        time.sleep(0.001)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    import asyncio  # only once the watch starts: not at every interpreter's start-up

    for obj in gc.get_objects():
        if isinstance(obj, asyncio.AbstractEventLoop) and obj.is_running():
            return obj
    return None


def _report() -> None:
    if not OUT:
        return
    top = sorted(_stalls, key=lambda where: -_stall_ms[where])[:15]
    with open(OUT, "w") as out:
        json.dump({"gc2": [{"at_s": at, "ms": ms, "frozen": frozen} for at, ms, frozen in _gc],
                   "stalls": [{"where": where, "count": _stalls[where], "ms": round(_stall_ms[where], 1)}
                              for where in top]}, out, indent=1)


if OUT:
    gc.callbacks.append(_on_gc)
    threading.Thread(target=_watch, daemon=True).start()
    atexit.register(_report)
