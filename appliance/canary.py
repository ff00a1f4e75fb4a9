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
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field
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
class WindowFigures:
    """One version's answers in one window, each user's counted up to a cap."""

    requests: int = 0
    errors: int = 0  # answered 5xx, or an engine error in a stream
    latencies_s: list[float] = field(default_factory=list)  # whole answers, not streams (a client's pace)
    ttfts_s: list[float] = field(default_factory=list)
    successes: int = 0  # outcome reports
    failures: int = 0
    satisfaction_sum: int = 0
    satisfaction_count: int = 0
    users: dict[str, int] = field(default_factory=dict)  # answers counted per user
    reporters: dict[str, int] = field(default_factory=dict)  # reports counted per user

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
        if self.reporters.get(user, 0) >= cap:
            return False
        self.reporters[user] = self.reporters.get(user, 0) + 1
        if success is not None:
            self.successes += success
            self.failures += not success
        if satisfaction is not None:
            self.satisfaction_sum += satisfaction
            self.satisfaction_count += 1
        return True

    def copy(self) -> WindowFigures:
        return WindowFigures(self.requests, self.errors, list(self.latencies_s), list(self.ttfts_s), self.successes,
                             self.failures, self.satisfaction_sum, self.satisfaction_count, dict(self.users),
                             dict(self.reporters))

    @property
    def satisfaction(self) -> float | None:
        """The mean satisfaction reported (1 to 5); None: none was."""
        return self.satisfaction_sum / self.satisfaction_count if self.satisfaction_count else None

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def reports(self) -> int:
        return self.successes + self.failures

    def summary(self) -> dict[str, float | int | None]:
        """The figures an audit record and the TUI show."""
        return {"requests": self.requests, "users": len(self.users), "reporters": len(self.reporters),
                "error_rate": round(self.error_rate, 4),
                "latency_p50_s": _median(self.latencies_s), "ttft_p50_s": _median(self.ttfts_s),
                "success_rate": round(self.successes / self.reports, 4) if self.reports else None,
                "satisfaction": None if self.satisfaction is None else round(self.satisfaction, 3)}


@dataclass(frozen=True)
class WindowVerdict:
    counted: bool  # both versions had enough requests
    failures: tuple[str, ...]  # how the canary was worse than allowed (counted windows only)


def judge(policy: CanaryAnalysis, stable: WindowFigures, canary: WindowFigures) -> WindowVerdict:
    """One window: whether it counts, and each metric on which the canary is worse than allowed."""
    if min(stable.requests, canary.requests) < policy.min_requests:
        return WindowVerdict(counted=False, failures=())
    failures = []
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
    if min(stable.reports, canary.reports) >= policy.min_feedback and \
            min(len(stable.reporters), len(canary.reporters)) >= policy.min_reporters:
        drop = stable.successes / stable.reports - canary.successes / canary.reports
        if drop > policy.max_success_drop:
            failures.append(f"success rate {canary.successes / canary.reports:.0%} vs "
                            f"{stable.successes / stable.reports:.0%} (allowed -{policy.max_success_drop:.0%})")
    if min(stable.satisfaction_count, canary.satisfaction_count) >= policy.min_feedback and \
            min(len(stable.reporters), len(canary.reporters)) >= policy.min_reporters and \
            stable.satisfaction is not None and canary.satisfaction is not None:
        if stable.satisfaction - canary.satisfaction > policy.max_satisfaction_drop:
            failures.append(f"satisfaction {canary.satisfaction:.2f} vs {stable.satisfaction:.2f} (allowed "
                            f"-{policy.max_satisfaction_drop:g})")
    return WindowVerdict(counted=True, failures=tuple(failures))


def decide(policy: CanaryAnalysis, passed_before: int, verdict: WindowVerdict) -> tuple[Decision, int]:
    """What follows a window, and the passing windows in a row after it."""
    if not verdict.counted:
        return "continue", passed_before
    if verdict.failures:
        return "abort", 0
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
