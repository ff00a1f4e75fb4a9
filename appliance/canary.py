"""Canary analysis: an adapter's canary version judged against its stable version on their own
numbers, window after window, as Argo Rollouts' and Flagger's analysis runs do.

A policy (CanaryAnalysis, kept with the alias in the registry) names the window, how many windows
in a row must pass to promote, the requests each version needs in a window for it to count, and
the degradation allowed per metric: error rate, median latency and time to first token (as
ratios), and, where clients report outcomes (the feedback endpoint), success rate and
satisfaction. A window in which either version has too few requests counts neither way; one in
which the canary is worse than allowed on any metric aborts it; `windows` passing windows in a row
promote it. The judgement (`judge`) is a pure function of the two versions' window figures; the
gateway gathers them (serve.canary) and acts on the verdict.

Outcomes are weighed by user, not by report: a version's success rate (and satisfaction) is the
median of its reporters' own rates, and a comparison decides only when it decides the same way
with any one user's reports left out (on both versions at once, a leave-one-out check). With
fewer than `min_reporters` users on either version it does not compare at all (the window passes
on the gateway's own figures, as when nobody reports); with enough users but one user's reports
deciding, the window is held (it counts neither way, like a window with too few requests). So no
single user's reports can turn a passing window into an abort, or an aborting one into a pass:
the most one user can do is hold the canary where it is, and then only while the users reporting
are few or split. A policy with `outcomes_required` never passes a window on the gateway's figures
alone: one whose outcomes are not compared counts neither way (a worse error rate or latency still
aborts).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from appliance.errors import Invalid

Decision = Literal["continue", "promote", "abort"]


class CanaryAnalysis(BaseModel):
    """How a canary is judged against the stable version (`appliance adapters canary --analysis`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    window_s: int = Field(60, ge=5, le=86400, description="The length of one window.")
    windows: int = Field(3, ge=1, le=1000, description="Passing windows in a row that promote the canary.")
    min_requests: int = Field(20, ge=1, le=1_000_000, description="Requests each version needs in a window for it "
                              "to count.")
    max_error_rate_increase: float = Field(0.02, ge=0, le=1, description="Canary's error rate less the stable "
                                           "version's.")
    max_latency_ratio: float = Field(1.5, ge=1, le=100, description="Canary's median latency over the stable "
                                     "version's.")
    max_ttft_ratio: float = Field(1.5, ge=1, le=100, description="Canary's median time to first token over the "
                                  "stable version's (streamed answers).")
    min_feedback: int = Field(5, ge=1, le=1_000_000, description="Outcome reports each version needs in a window "
                              "for success rate and satisfaction to be compared...")
    min_reporters: int = Field(3, ge=1, le=10_000, description="...from at least this many users each.")
    max_per_user: int = Field(100, ge=1, le=1_000_000, description="Answers, and reports, of one user counted per "
                              "version and window: no one user decides.")
    max_success_drop: float = Field(0.1, ge=0, le=1, description="The stable version's reported success rate less "
                                    "the canary's.")
    max_satisfaction_drop: float = Field(0.5, ge=0, le=4, description="The stable version's mean satisfaction (1 to "
                                         "5) less the canary's.")
    outcomes_required: bool = Field(False, description="A window counts only once clients' reports compare the "
                                    "versions' success rate or satisfaction (enough reports and users on both); "
                                    "otherwise a window with too few passes on the gateway's own figures.")


def parse_analysis(text: str) -> CanaryAnalysis:
    """`key=value,key=value` (CanaryAnalysis's fields; the rest keep their defaults), or Invalid
    naming the item or field at fault."""
    fields: dict[str, str] = {}
    hint = f"keys: {', '.join(CanaryAnalysis.model_fields)}"
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or not key.strip() or not value.strip():
            raise Invalid(f"--analysis: {item.strip()!r} is not key=value", hint=hint)
        if key.strip() in fields:
            raise Invalid(f"--analysis: {key.strip()} is given twice", hint=hint)
        fields[key.strip()] = value.strip()
    try:
        return CanaryAnalysis.model_validate(fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"]) or "analysis"
        raise Invalid(f"--analysis: {where}: {error['msg']}", hint=hint) from None


MAX_SAMPLES = 10_000  # latencies kept per version and window (a uniform sample of them past that)


@dataclass
class Outcomes:
    """One user's outcome reports on one version in one window."""

    reports: int = 0  # counted against the cap: each report, with success, satisfaction or both
    successes: int = 0
    failures: int = 0
    satisfaction_sum: int = 0
    satisfaction_count: int = 0


@dataclass
class WindowFigures:
    """One version's answers in one window, each user's counted up to a cap."""

    requests: int = 0
    errors: int = 0  # answered 5xx, or an engine error in a stream
    latencies_s: list[float] = field(default_factory=list)  # whole answers, not streams (a client's pace)
    ttfts_s: list[float] = field(default_factory=list)
    users: dict[str, int] = field(default_factory=dict)  # answers counted per user
    reporters: dict[str, Outcomes] = field(default_factory=dict)  # reports counted per user

    def add(self, user: str, *, error: bool, latency_s: float | None, ttft_s: float | None, cap: int) -> bool:
        """Count an answer; False past the user's cap."""
        if self.users.get(user, 0) >= cap:
            return False
        self.users[user] = self.users.get(user, 0) + 1
        self.requests += 1
        self.errors += error
        for samples, value in ((self.latencies_s, latency_s), (self.ttfts_s, ttft_s)):
            if value is not None:
                _sample(samples, value, self.requests)
        return True

    def report(self, user: str, success: bool | None, satisfaction: int | None, cap: int) -> bool:
        """Count an outcome report; False past the user's cap."""
        mine = self.reporters.setdefault(user, Outcomes())
        if mine.reports >= cap:
            return False
        mine.reports += 1
        if success is not None:
            mine.successes += success
            mine.failures += not success
        if satisfaction is not None:
            mine.satisfaction_sum += satisfaction
            mine.satisfaction_count += 1
        return True

    def copy(self) -> WindowFigures:
        return WindowFigures(self.requests, self.errors, list(self.latencies_s), list(self.ttfts_s), dict(self.users),
                             {user: replace(mine) for user, mine in self.reporters.items()})

    def success_rates(self) -> dict[str, Rated]:
        """Each reporting user's own success rate, with the reports it rests on."""
        return {user: Rated(mine.successes / (mine.successes + mine.failures), mine.successes + mine.failures)
                for user, mine in self.reporters.items() if mine.successes + mine.failures}

    def satisfactions(self) -> dict[str, Rated]:
        """Each reporting user's own mean satisfaction (1 to 5), with the reports it rests on."""
        return {user: Rated(mine.satisfaction_sum / mine.satisfaction_count, mine.satisfaction_count)
                for user, mine in self.reporters.items() if mine.satisfaction_count}

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def summary(self) -> dict[str, float | int | None]:
        """The figures an audit record and the TUI show (success rate and satisfaction: the median
        of the users' own)."""
        success, satisfaction = _median_of(self.success_rates()), _median_of(self.satisfactions())
        return {"requests": self.requests, "users": len(self.users),
                "reporters": sum(1 for mine in self.reporters.values() if mine.reports),
                "error_rate": round(self.error_rate, 4),
                "latency_p50_s": _median(self.latencies_s), "ttft_p50_s": _median(self.ttfts_s),
                "success_rate": None if success is None else round(success, 4),
                "satisfaction": None if satisfaction is None else round(satisfaction, 3)}


@dataclass(frozen=True)
class Rated:
    """One user's own figure for a version (a rate, a mean) and the reports it rests on."""

    value: float
    reports: int


Comparison = Literal["uncompared", "fine", "worse", "held"]


@dataclass(frozen=True)
class WindowVerdict:
    counted: bool  # both versions had enough requests
    failures: tuple[str, ...]  # how the canary was worse than allowed (counted windows only)
    held: tuple[str, ...] = ()  # outcomes one user's reports would decide: the window counts neither way


def judge(policy: CanaryAnalysis, stable: WindowFigures, canary: WindowFigures) -> WindowVerdict:
    """One window: whether it counts, each metric on which the canary is worse than allowed, and
    each outcome that one user's reports alone would decide."""
    if min(stable.requests, canary.requests) < policy.min_requests:
        return WindowVerdict(counted=False, failures=())
    failures, held, compared = [], [], False
    increase = canary.error_rate - stable.error_rate
    if increase > policy.max_error_rate_increase:
        failures.append(f"error rate {canary.error_rate:.1%} vs {stable.error_rate:.1%} (allowed "
                        f"+{policy.max_error_rate_increase:.1%})")
    for what, ours, theirs, allowed in (("median latency", canary.latencies_s, stable.latencies_s,
                                         policy.max_latency_ratio),
                                        ("median time to first token", canary.ttfts_s, stable.ttfts_s,
                                         policy.max_ttft_ratio)):
        if ours and theirs and (base := statistics.median(theirs)) > 0 and \
                (ratio := statistics.median(ours) / base) > allowed:
            failures.append(f"{what} {statistics.median(ours):.3f} s vs {base:.3f} s ({ratio:.2f} x, allowed "
                            f"{allowed:g} x)")
    success = (stable.success_rates(), canary.success_rates())
    satisfaction = (stable.satisfactions(), canary.satisfactions())
    for what, (theirs_by_user, ours_by_user), allowed, shown, limit in (
            ("success rate", success, policy.max_success_drop, "{:.0%}", f"{policy.max_success_drop:.0%}"),
            ("satisfaction", satisfaction, policy.max_satisfaction_drop, "{:.2f}",
             f"{policy.max_satisfaction_drop:g}")):
        outcome = compare_outcomes(policy, theirs_by_user, ours_by_user, allowed)
        compared = compared or outcome != "uncompared"
        if outcome in ("uncompared", "fine"):
            continue
        figures = f"{what} {shown.format(_median_of(ours_by_user))} vs {shown.format(_median_of(theirs_by_user))} " \
                  f"(allowed -{limit}; medians of {len(ours_by_user)} and {len(theirs_by_user)} users' own)"
        if outcome == "worse":
            failures.append(figures)
        else:
            held.append(f"{figures}: one user's reports would decide it")
    if policy.outcomes_required and not compared and not failures:
        return WindowVerdict(counted=False, failures=())  # the gateway's figures alone do not decide
    return WindowVerdict(counted=True, failures=tuple(failures), held=tuple(held))


def compare_outcomes(policy: CanaryAnalysis, stable: dict[str, Rated], canary: dict[str, Rated],
                     allowed: float) -> Comparison:
    """Whether the canary's outcome (the median of its users' own figures) is worse than the
    stable version's by more than `allowed`: "uncompared" with too few reports or users; "worse"
    or "fine" only when every leave-one-user-out comparison that still has enough says the same;
    else "held". Linear in the users after a sort: each left-out median comes from the ranks."""
    def enough(reports: tuple[int, int], users: tuple[int, int]) -> bool:
        return min(reports) >= policy.min_feedback and min(users) >= policy.min_reporters

    totals = (sum(rated.reports for rated in stable.values()), sum(rated.reports for rated in canary.values()))
    if not enough(totals, (len(stable), len(canary))):
        return "uncompared"
    full = (_median_of(stable), _median_of(canary))
    without = (_medians_without(stable), _medians_without(canary))
    worse = _drop(full) > allowed
    for user in stable.keys() | canary.keys():
        left = (stable.get(user), canary.get(user))
        reports = (totals[0] - (left[0].reports if left[0] else 0), totals[1] - (left[1].reports if left[1] else 0))
        if not enough(reports, (len(stable) - (left[0] is not None), len(canary) - (left[1] is not None))):
            if worse:
                return "held"  # without this user there would be nothing to compare: they would decide
            continue
        medians = (without[0].get(user, full[0]), without[1].get(user, full[1]))
        if (_drop(medians) > allowed) != worse:
            return "held"
    return "worse" if worse else "fine"


def _drop(medians: tuple[float | None, float | None]) -> float:
    stable, canary = medians
    assert stable is not None and canary is not None  # enough users on both sides
    return stable - canary


def _median_of(by_user: dict[str, Rated]) -> float | None:
    return statistics.median(rated.value for rated in by_user.values()) if by_user else None


def _medians_without(by_user: dict[str, Rated]) -> dict[str, float | None]:
    """For each user, the median of the others' figures (None: no others)."""
    ranked = sorted(by_user.items(), key=lambda item: item[1].value)
    values = [rated.value for _, rated in ranked]
    rest = len(values) - 1
    found: dict[str, float | None] = {}
    for index, (user, _) in enumerate(ranked):
        def at(position: int, index: int = index) -> float:  # the position among the others
            return values[position if position < index else position + 1]
        if rest == 0:
            found[user] = None
        elif rest % 2:
            found[user] = at(rest // 2)
        else:
            found[user] = (at(rest // 2 - 1) + at(rest // 2)) / 2
    return found


def decide(policy: CanaryAnalysis, passed_before: int, verdict: WindowVerdict) -> tuple[Decision, int]:
    """What follows a window, and the passing windows in a row after it."""
    if not verdict.counted:
        return "continue", passed_before
    if verdict.failures:
        return "abort", 0
    if verdict.held:
        return "continue", passed_before
    passed = passed_before + 1
    return ("promote" if passed >= policy.windows else "continue"), passed


def _sample(samples: list[Any], value: Any, seen: int) -> None:
    """Keep `value` (the `seen`-th) in a uniform sample of at most MAX_SAMPLES (reservoir sampling)."""
    if len(samples) < MAX_SAMPLES:
        samples.append(value)
    elif (slot := random.randrange(seen)) < MAX_SAMPLES:
        samples[slot] = value


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None
