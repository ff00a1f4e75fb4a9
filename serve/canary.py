"""The gateway's side of canary analysis (appliance.canary): each adapter answer's figures gathered
per version into the current window of its name, clients' outcome reports (POST /v1/feedback)
matched to the answer they judge, and, when a window ends, the verdict acted on: the canary
promoted or aborted through the adapter routes, each decision an audit record with its figures.

Figures live in memory: a gateway that restarts starts a fresh window (the analysis itself is kept
with the alias). Only answers the gateway relayed count, and 4xx (a client's fault, a limit) do
not: they say nothing of the version."""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from appliance.adapters import Alias
from appliance.canary import CanaryAnalysis, Decision, WindowFigures, WindowVerdict, decide, judge
from appliance.errors import Conflict, NotFound

MAX_ANSWERS = 100_000  # answers kept for outcome reports, newest last...
MAX_ANSWERS_PER_USER = 1000  # ...and per user (one user's flood does not push out everyone else's)
ANSWER_TTL_S = 3600.0  # an outcome can be reported this long after its answer


@dataclass(frozen=True)
class Answered:
    name: str
    version: int
    subject: str
    at: float
    window: float | None  # the start of the window it was served in (None: no analysis ran)
    reported: bool = False


@dataclass
class Window:
    """The current window of one adapter name with an analysed canary."""

    stable: int
    canary: int
    policy: CanaryAnalysis
    started: float
    passed: int = 0  # passing windows in a row before this one
    figures: dict[int, WindowFigures] = field(default_factory=dict)

    def of(self, version: int) -> WindowFigures | None:
        if version not in (self.stable, self.canary):
            return None
        return self.figures.setdefault(version, WindowFigures())

    def copy(self) -> Window:
        return Window(self.stable, self.canary, self.policy, self.started, self.passed,
                      {version: figures.copy() for version, figures in self.figures.items()})

    def status(self, now: float) -> dict[str, object]:
        """What the admin API and the TUI show of the analysis as it runs."""
        return {"stable": self.stable, "canary": self.canary, "policy": self.policy.model_dump(),
                "passed_windows": self.passed, "window_left_s": round(max(0.0, self.started + self.policy.window_s
                                                                           - now), 1),
                "stable_figures": (self.of(self.stable) or WindowFigures()).summary(),
                "canary_figures": (self.of(self.canary) or WindowFigures()).summary()}


@dataclass(frozen=True)
class Ended:
    """A window that ended, and what follows it."""

    name: str
    window: Window
    verdict: WindowVerdict
    decision: Decision

    def detail(self) -> str:
        """The decision with its figures, for the audit record."""
        stable, canary = self.window.of(self.window.stable), self.window.of(self.window.canary)
        figures = {"stable": stable.summary() if stable else None, "canary": canary.summary() if canary else None}
        why = "; ".join(self.verdict.failures) or f"{self.window.passed + 1} passing windows of " \
                                                     f"{self.window.policy.window_s} s"
        done = {"promote": "promoted", "abort": "aborted", "continue": "kept"}[self.decision]
        return (f"{self.name} v{self.window.canary} {done} against v{self.window.stable}: {why}; figures "
                f"{json.dumps(figures, separators=(',', ':'))}")


class CanaryWatch:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._windows: dict[str, Window] = {}
        self._answers: OrderedDict[str, Answered] = OrderedDict()
        self._by_user: dict[str, deque[str]] = {}  # each user's answer ids, oldest first

    def served(self, name: str, version: int, subject: str, answer_id: str | None, *, status: int, failed: bool,
               latency_s: float | None, ttft_s: float | None) -> None:
        """An adapter version's answer, as its audit record was written (`latency_s` None: a
        stream, whose end the client's pace sets)."""
        if 400 <= status < 500:
            return
        with self._lock:
            now = self.clock()
            window = self._windows.get(name)
            figures = window.of(version) if window is not None else None
            if window is not None and figures is not None:
                figures.add(subject, error=status >= 500 or failed, latency_s=latency_s, ttft_s=ttft_s,
                            cap=window.policy.max_per_user)
            if answer_id and status < 400 and answer_id not in self._answers:
                started = window.started if window is not None and figures is not None else None
                self._keep(answer_id, Answered(name, version, subject, now, started))

    def _keep(self, answer_id: str, answered: Answered) -> None:
        self._answers[answer_id] = answered
        mine = self._by_user.setdefault(answered.subject, deque())
        mine.append(answer_id)
        while len(mine) > MAX_ANSWERS_PER_USER:
            self._answers.pop(mine.popleft(), None)
        while len(self._answers) > MAX_ANSWERS:
            oldest, gone = self._answers.popitem(last=False)
            theirs = self._by_user.get(gone.subject)
            if theirs and theirs[0] == oldest:
                theirs.popleft()
            if theirs is not None and not theirs:
                del self._by_user[gone.subject]

    def report(self, answer_id: str, subject: str, success: bool | None,
               satisfaction: int | None) -> tuple[Answered, bool]:
        """A client's outcome report on the adapter answer `answer_id` it got within ANSWER_TTL_S:
        the answer, and whether an analysis running now counted the report. NotFound for an answer
        unknown, too old or another's; Conflict for a second report on one answer (one vote each)."""
        with self._lock:
            found = self._answers.get(answer_id)
            if found is None or found.subject != subject or self.clock() - found.at > ANSWER_TTL_S:
                raise NotFound("no adapter answer with this id was given to you in the last hour")
            if found.reported:
                raise Conflict("this answer has already been reported on")
            self._answers[answer_id] = replace(found, reported=True)
            window = self._windows.get(found.name)
            if window is None or found.window != window.started:  # only answers of the window running now count
                return found, False
            figures = window.of(found.version)
            counted = figures is not None and figures.report(subject, success, satisfaction, window.policy.max_per_user)
            return found, counted

    def tick(self, aliases: dict[str, Alias]) -> list[Ended]:
        """Follow the aliases (a canary begun, changed or gone starts or drops its window) and end
        the windows whose time is up: each judged, with what follows."""
        ended = []
        with self._lock:
            now = self.clock()
            for name in [name for name in self._windows if name not in aliases]:
                del self._windows[name]
            for name, alias in aliases.items():
                window = self._follow(name, alias, now)
                if window is None or now - window.started < window.policy.window_s:
                    continue
                verdict = judge(window.policy, window.of(window.stable) or WindowFigures(),
                                window.of(window.canary) or WindowFigures())
                decision, passed = decide(window.policy, window.passed, verdict)
                ended.append(Ended(name, window, verdict, decision))
                if decision == "continue":
                    self._windows[name] = Window(window.stable, window.canary, window.policy, now, passed)
                else:
                    del self._windows[name]  # the alias changes next; a new canary starts afresh
        return ended

    def _follow(self, name: str, alias: Alias, now: float) -> Window | None:
        """The window of `alias`'s analysed canary, begun `now` if it has none yet or one of another
        canary (or policy); None, its window dropped, when it has no analysed canary. Under the lock."""
        if alias.canary is None or alias.stable is None or alias.canary_analysis is None:
            self._windows.pop(name, None)
            return None
        window = self._windows.get(name)
        if window is None or (window.stable, window.canary, window.policy) != \
                (alias.stable, alias.canary, alias.canary_analysis):
            window = self._windows[name] = Window(alias.stable, alias.canary, alias.canary_analysis, now)
        return window

    def status(self, name: str, alias: Alias) -> dict[str, object] | None:
        """The current window of `alias`'s analysed canary (begun now if the watch has not seen it
        yet: a canary just started, a gateway just restarted); None when it is not analysed."""
        with self._lock:  # figures copied under the lock, summed up outside it
            now = self.clock()
            window = self._follow(name, alias, now)
            found = None if window is None else window.copy()
        return None if found is None else found.status(now)
