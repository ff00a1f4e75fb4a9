"""Settings a program takes while it runs, without a restart: `appliance settings apply` sends it
SIGHUP (through supervisord); it reads the settings file again, puts the keys in LIVE_KEYS in
force and says so in run/live-settings/PROGRAM.json: the digest of those keys' values as it now
holds them, or why it could not (the values in force stay). `apply` waits for that answer and
restarts the program, saying so, when it does not come or does not match.

The gateway takes `gateway.limits` this way: a restart would refuse every request sent while it
is down.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from appliance.durable import read_small_file, replace_file
from appliance.home import Home

# Program -> the keys (a table's stands for every key under it) it takes while running.
LIVE_KEYS: dict[str, tuple[str, ...]] = {"gateway": ("gateway.limits",)}
ANSWER_TIMEOUT_S = 15.0
MAX_ANSWER_BYTES = 65536


class Taken(BaseModel):
    """A program's answer to SIGHUP."""

    model_config = ConfigDict(extra="forbid")

    pid: int
    digest: str | None = Field(description="Of the live keys' values it now holds; None: it took nothing.")
    problem: str | None = Field(None, max_length=4096, description="Why it took nothing.")


def is_live(program: str, key: str) -> bool:
    """Whether `program` takes `key` while it runs."""
    return any(key == live or key.startswith(f"{live}.") for live in LIVE_KEYS.get(program, ()))


def digest(program: str, comparable: Mapping[str, Any]) -> str:
    """The digest of `program`'s live keys' values in `comparable` (Settings.comparable())."""
    values = {}
    for key in LIVE_KEYS[program]:
        found: Any = comparable
        for part in key.split("."):
            found = found.get(part) if isinstance(found, Mapping) else None
        values[key] = found
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()


def answer_file(home: Home, program: str) -> Path:
    return home.run / "live-settings" / f"{program}.json"


def say_taken(home: Home, program: str, answer: Taken) -> None:
    """The program's answer (written whole, 0600)."""
    path = answer_file(home, program)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    replace_file(path, answer.model_dump_json().encode())


def forget_answer(home: Home, program: str) -> None:
    answer_file(home, program).unlink(missing_ok=True)


def await_answer(home: Home, program: str, pid: int, expected: str) -> str | None:
    """None once `program` (process `pid`) says it holds the values with digest `expected`; else
    why not (its problem, another digest, or no answer within ANSWER_TIMEOUT_S)."""
    timeout_s = ANSWER_TIMEOUT_S
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = read_small_file(answer_file(home, program), MAX_ANSWER_BYTES)
        if found is not None:
            try:
                answer = Taken.model_validate_json(found[0])
            except ValueError:
                answer = None
            if answer is not None and answer.pid == pid:
                if answer.problem is not None or answer.digest is None:
                    return answer.problem or "it took nothing"
                return None if answer.digest == expected else "it holds other values than the settings file's"
        time.sleep(0.1)
    return f"no answer within {timeout_s:g} s"
