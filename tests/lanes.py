"""A pytest plugin: pytest-xdist's whole-module scheduling (--dist loadfile), with some modules
pinned to a worker (tests/conftest.py's LANES).

A worker takes the next module in the run's order that is pinned to it or to no worker; once none
is left, it takes the last module pinned to another worker, so that neither sits idle at the end.
pytest-xdist gives a worker its next module before the last test of the one it runs starts (the
worker needs the next test to know which fixtures to end), so with plain loadfile, which module a
worker gets next depends on which worker finished first: a long one-test module took the module
after it at once, and a module that must run alone waited behind the other worker's long module
with its worker idle. Pinning puts each module that runs alone on the worker that is busy with
unit tests meanwhile, whatever finishes first."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from xdist.scheduler import LoadFileScheduling  # type: ignore[import-untyped]  # xdist ships no types


class LaneScheduling(LoadFileScheduling):  # type: ignore[misc]  # its base is untyped
    """LoadFileScheduling that honours `lane` (a module's path -> the worker it is pinned to, or None)."""

    def __init__(self, config: pytest.Config, log: Any, lane: Callable[[str], int | None]) -> None:
        super().__init__(config, log)
        self.lane = lane

    def _assign_work_unit(self, node: Any) -> None:
        worker = int(node.gateway.id.removeprefix("gw"))
        scopes = list(self.workqueue)
        mine = [s for s in scopes if self.lane(s) in (worker, None)]
        scope = mine[0] if mine else scopes[-1]
        self.workqueue.move_to_end(scope, last=False)  # the parent takes the first in the queue
        super()._assign_work_unit(node)
