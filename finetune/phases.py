"""The trainer's progress through a job's phases, as Progress reports for the job's progress file:
each training step's, then the evaluation gate's start and each of its evaluations (one evaluation
set at one seed, base and adapter), with the gate's ETA from its rate so far."""

from __future__ import annotations

import time
from collections.abc import Callable

from appliance.jobs import Phase, Progress


class Phases:
    """Reports a trainer's progress (`report`: the job's progress file) as it moves from training
    to the gate."""

    def __init__(self, report: Callable[[Progress], None], clock: Callable[[], float] = time.monotonic) -> None:
        self._report, self._clock = report, clock
        self._trained: Progress | None = None

    def trained(self, progress: Progress) -> None:
        """A training step's report, passed on (its loss and rate stay in the gate's reports)."""
        self._trained = progress
        self._report(progress)

    def gate(self, evaluations: int, *, step: int, max_steps: int) -> Callable[[], None]:
        """The gate begins, after `step` of `max_steps` steps: the held-out loss, then `evaluations`
        (sets x seeds). Returns what to call as each evaluation is done."""
        started = self._clock()
        last = self._trained
        progress = Progress(step=step, max_steps=max_steps, loss=last.loss if last else None,
                            tokens_per_s=last.tokens_per_s if last else 0.0, eta_s=None, phase=Phase.EVALUATING,
                            evaluations=0, evaluations_total=evaluations)
        self._report(progress)

        def evaluated() -> None:
            nonlocal progress
            done = progress.evaluations + 1
            if done > evaluations:
                raise ValueError(f"evaluation {done} of a gate of {evaluations}")
            elapsed = self._clock() - started
            progress = progress.model_copy(update={"evaluations": done,
                                                   "eta_s": elapsed / done * (evaluations - done)})
            self._report(progress)

        return evaluated
