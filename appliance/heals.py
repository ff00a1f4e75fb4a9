"""What the watchdog (serve.watchdog) has healed: each engine replica's restarts by reason, kept in
run/watchdog-restarts.json so that they outlive the watchdog's own restarts. The gateway exports
them (`appliance_watchdog_restarts_total`), and the EngineHealed alert pages on them."""

from __future__ import annotations

import logging
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, Field, ValidationError

from appliance.durable import read_small_file, replace_file
from appliance.home import Home

MAX_BYTES = 1 << 20
log = logging.getLogger(__name__)


class Reason(StrEnum):
    UNHEALTHY = "unhealthy"  # its health check did not answer 200
    NO_PROGRESS = "no_progress"  # it held requests and produced nothing
    GAVE_UP = "gave_up"  # supervisord gave up on it (FATAL) after its start retries


class Heals(BaseModel):
    """Restarts per replica (its program's name) and reason, and the pool of each replica."""

    restarts: dict[str, dict[Reason, Annotated[int, Field(ge=0)]]] = {}
    pools: dict[str, str] = {}

    def count(self, replica: str, pool: str, reason: Reason) -> None:
        by_reason = self.restarts.setdefault(replica, {})
        by_reason[reason] = by_reason.get(reason, 0) + 1
        self.pools[replica] = pool


def load(home: Home) -> Heals:
    """The restarts counted so far; none when the file is missing, not a plain file or not whole."""
    found = read_small_file(home.run / "watchdog-restarts.json", MAX_BYTES)
    if found is None:
        return Heals()
    try:
        return Heals.model_validate_json(found[0])
    except ValidationError as exc:
        log.warning("watchdog-restarts.json is not readable, counting from zero: %s", exc)
        return Heals()


def save(home: Home, heals: Heals) -> None:
    replace_file(home.run / "watchdog-restarts.json", heals.model_dump_json().encode())
