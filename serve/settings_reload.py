"""The gateway takes its limits while it runs: on SIGHUP (`appliance settings apply`) it reads the
settings file again, holds every user to the new `gateway.limits` from their next request on, and
answers in the run directory (appliance.live_settings). A settings file that does not validate
changes nothing: the limits in force stay, and the answer says why."""

from __future__ import annotations

import logging
import os
import signal

import anyio

from appliance import live_settings
from appliance.errors import ApplianceError
from appliance.home import Home
from appliance.settings import load_settings
from serve.limits import RateLimiter

log = logging.getLogger("appliance.gateway")
PROGRAM = "gateway"


async def take_settings_on_hangup(limiter: RateLimiter, home: Home) -> None:
    """Until cancelled: each SIGHUP, the settings file's limits put in force (take_limits)."""
    with anyio.open_signal_receiver(signal.SIGHUP) as hangups:
        async for _ in hangups:
            take_limits(limiter, home)


def take_limits(limiter: RateLimiter, home: Home) -> None:
    """The settings file's `gateway.limits` in force, and the answer said; or, where the file
    cannot be read or does not validate, nothing changed and the answer says why."""
    try:
        fresh = load_settings(home.settings_file)
    except Exception as exc:  # whatever the file holds, the gateway keeps serving with what it has
        problem = exc.message if isinstance(exc, ApplianceError) else f"{type(exc).__name__}: {exc}"
        log.warning("the settings file was not taken on SIGHUP; the limits in force stay: %s", problem)
        answer = live_settings.Taken(pid=os.getpid(), digest=None, problem=problem[:4096])
    else:
        limiter.reload(fresh.gateway.limits)
        log.info("gateway.limits taken from the settings file on SIGHUP")
        answer = live_settings.Taken(pid=os.getpid(), digest=live_settings.digest(PROGRAM, fresh.comparable()))
    try:
        live_settings.say_taken(home, PROGRAM, answer)
    except OSError as exc:  # apply then restarts the gateway, saying it had no answer
        log.warning("the answer to SIGHUP could not be written: %s", exc)
