"""Canary analysis: the judgement of one window (appliance.canary), what follows it, the policy as
the CLI reads it, and the gateway's gathering of figures and outcome reports on a clock of the
test's own (serve.canary)."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.adapters import Alias
from appliance.canary import (
    CanaryAnalysis,
    Rated,
    WindowFigures,
    WindowVerdict,
    compare_outcomes,
    decide,
    judge,
    parse_analysis,
)
from appliance.errors import Conflict, Invalid, NotFound
from serve.canary import ANSWER_TTL_S, MAX_ANSWERS_PER_USER, CanaryWatch

POLICY = CanaryAnalysis(window_s=10, windows=2, min_requests=5, min_feedback=4, min_reporters=2, max_per_user=10,
                        max_success_drop=0.2)


def figures(requests: int, *, errors: int = 0, latency_s: float = 1.0, ttft_s: float | None = None,
            successes: int = 0, failures: int = 0, satisfaction: tuple[int, ...] = ()) -> WindowFigures:
    """A version's window, each answer and report from a user of its own."""
    found = WindowFigures()
    for n in range(requests):
        assert found.add(f"u{n}", error=n < errors, latency_s=latency_s, ttft_s=ttft_s, cap=10)
    for n in range(successes + failures):
        assert found.report(f"u{n}", n < successes, None, cap=10)
    for n, score in enumerate(satisfaction):
        assert found.report(f"s{n}", None, score, cap=10)
    return found


def test_a_window_with_too_few_requests_on_either_side_counts_neither_way() -> None:
    assert judge(POLICY, figures(100), figures(4)) == WindowVerdict(counted=False, failures=())
    assert judge(POLICY, figures(4), figures(100, errors=100)).counted is False
    assert decide(POLICY, 1, WindowVerdict(counted=False, failures=())) == ("continue", 1)


def test_each_metric_worse_than_allowed_fails_the_window_naming_it() -> None:
    stable = figures(20, errors=0, latency_s=1.0, ttft_s=0.2, successes=9, failures=1, satisfaction=(5, 5, 4, 5, 5))
    assert judge(POLICY, stable, figures(20, latency_s=1.4, ttft_s=0.25, successes=8, failures=2,
                                         satisfaction=(5, 4, 4, 5))).failures == ()
    [errors] = judge(POLICY, stable, figures(20, errors=2)).failures
    assert errors == "error rate 10.0% vs 0.0% (allowed +2.0%)"
    [latency] = judge(POLICY, stable, figures(20, latency_s=2.0)).failures
    assert latency == "median latency 2.000 s vs 1.000 s (2.00 x, allowed 1.5 x)"
    [ttft] = judge(POLICY, stable, figures(20, ttft_s=0.5)).failures
    assert ttft.startswith("median time to first token 0.500 s vs 0.200 s")
    [success] = judge(POLICY, stable, figures(20, successes=2, failures=8)).failures
    assert success == "success rate 0% vs 100% (allowed -20%; medians of 10 and 10 users' own)"
    [satisfied] = judge(POLICY, stable, figures(20, satisfaction=(2, 3, 2, 2, 2))).failures
    assert satisfied == "satisfaction 2.00 vs 5.00 (allowed -0.5; medians of 5 and 5 users' own)"
    assert judge(POLICY, stable, figures(20, successes=0, failures=3)).failures == (), "too few reports to compare"


def test_a_policy_requiring_outcomes_counts_no_window_without_them_yet_still_aborts_on_errors() -> None:
    required = POLICY.model_copy(update={"outcomes_required": True})
    quiet, reported = figures(20), figures(20, successes=9, failures=1)
    assert judge(POLICY, quiet, quiet) == WindowVerdict(counted=True, failures=()), "passes on the gateway's figures"
    assert judge(required, quiet, quiet) == WindowVerdict(counted=False, failures=())
    assert judge(required, reported, figures(20, successes=1, failures=2)).counted is False, "too few to compare"
    assert judge(required, reported, figures(20, successes=8, failures=2)) == WindowVerdict(counted=True, failures=())
    assert judge(required, quiet, figures(20, errors=5)).failures, "a worse error rate aborts with no reports too"
    assert judge(required, reported, figures(20, successes=1, failures=9)).failures
    assert parse_analysis("outcomes_required=true").outcomes_required is True


def test_passing_windows_in_a_row_promote_and_one_failing_aborts() -> None:
    passing, failing = WindowVerdict(True, ()), WindowVerdict(True, ("error rate",))
    assert decide(POLICY, 0, passing) == ("continue", 1)
    assert decide(POLICY, 1, passing) == ("promote", 2)
    assert decide(POLICY, 1, failing) == ("abort", 0)


@given(stable=st.lists(st.floats(0.01, 100), min_size=5, max_size=30),
       canary=st.lists(st.floats(0.01, 100), min_size=5, max_size=30),
       errors=st.integers(0, 5), canary_errors=st.integers(0, 5))
def test_a_canary_no_worse_than_stable_never_fails(stable: list[float], canary: list[float], errors: int,
                                                   canary_errors: int) -> None:
    same = WindowFigures(requests=len(stable), errors=min(errors, len(stable)), latencies_s=stable)
    assert judge(POLICY, same, same.copy()).failures == ()
    other = WindowFigures(requests=len(canary), errors=min(canary_errors, len(canary)), latencies_s=canary)
    verdict = judge(POLICY, same, other)
    assert verdict.counted and all(isinstance(reason, str) and reason for reason in verdict.failures)


def test_no_one_user_decides_and_the_samples_stay_bounded() -> None:
    one = WindowFigures()
    counted = [one.add("mallory", error=False, latency_s=0.1, ttft_s=None, cap=10) for _ in range(50)]
    assert sum(counted) == 10 and one.requests == 10, "one user's answers count up to the cap"
    reported = [one.report("mallory", False, 1, cap=10) for _ in range(50)]
    assert sum(reported) == 10 and len(one.reporters) == 1
    stable = figures(10, successes=10)
    # Ten failures and the worst satisfaction from one user: too few reporters to compare outcomes.
    assert judge(POLICY, stable, one).failures == ()
    many = WindowFigures()
    for n in range(30_000):
        many.add(f"u{n % 5000}", error=False, latency_s=float(n), ttft_s=float(n), cap=10)
    assert len(many.latencies_s) == len(many.ttfts_s) == 10_000 and many.requests == 30_000


Report = tuple[str, str, bool | None, int | None]  # user, version, success, satisfaction


def reported(reports: list[Report], cap: int = 100) -> tuple[WindowFigures, WindowFigures]:
    """Both versions' figures in a window with plenty of identical answers and these reports."""
    found = {"stable": WindowFigures(), "canary": WindowFigures()}
    for figures_of in found.values():
        for n in range(30):
            figures_of.add(f"client{n}", error=False, latency_s=1.0, ttft_s=None, cap=cap)
    for user, version, success, satisfaction in reports:
        found[version].report(user, success, satisfaction, cap)
    return found["stable"], found["canary"]


def outcome(verdict: WindowVerdict) -> str:
    if not verdict.counted or verdict.held:
        return "held"
    return "abort" if verdict.failures else "pass"


DEFAULTS = CanaryAnalysis(min_requests=20)  # the default feedback policy: min_feedback 5, 3 reporters, cap 100


@pytest.mark.parametrize(("reports", "expected"), [
    # One user's selective failure reports against two users' full success: the canary passes.
    ([*[(u, "stable", True, 5) for u in ("ann", "bob", "cat") for _ in range(3)],
      *[("mallory", "canary", False, 1)] * 100, *[(u, "canary", True, 5) for u in ("ann", "bob") for _ in range(3)]],
     "pass"),
    # With a policy of two reporters and one other user on the canary, that user alone would decide
    # it: the window is held.
    ([*[(u, "stable", True, 5) for u in ("ann", "bob") for _ in range(3)],
      *[("mallory", "canary", False, 1)] * 100, *[("ann", "canary", True, 5)] * 3], "held:2"),
    # A bad canary: four users see it fail; one user's flood of successes does not save it.
    ([*[(u, "stable", True, 5) for u in ("ann", "bob", "cat", "dan") for _ in range(2)],
      *[("mallory", "canary", True, 5)] * 100,
      *[(u, "canary", False, 1) for u in ("ann", "bob", "cat", "dan") for _ in range(2)]],
     "abort"),
    # One user alone reporting, however often: nothing to compare (the gateway's own figures decide).
    ([*[("mallory", "stable", True, 5)] * 50, *[("mallory", "canary", False, 1)] * 50], "pass"),
    # Three users each way and all of them agree it is worse: the fourth one missing, any one decides.
    ([*[(u, "stable", True, 5) for u in ("ann", "bob", "cat") for _ in range(2)],
      *[(u, "canary", False, 1) for u in ("ann", "bob", "cat") for _ in range(2)]], "held"),
])
def test_outcomes_weigh_users_not_reports(reports: list[Report], expected: str) -> None:
    expected, _, reporters = expected.partition(":")
    policy = DEFAULTS.model_copy(update={"min_reporters": int(reporters)}) if reporters else DEFAULTS
    assert outcome(judge(policy, *reported(reports))) == expected


@given(reports=st.lists(st.tuples(st.sampled_from(["u1", "u2", "u3", "u4", "u5", "u6"]),
                                  st.sampled_from(["stable", "canary"]), st.none() | st.booleans(),
                                  st.none() | st.integers(1, 5)), max_size=60),
       left_out=st.sampled_from(["u1", "u2", "u3", "u4", "u5", "u6"]),
       min_feedback=st.integers(1, 6), min_reporters=st.integers(1, 4),
       max_success_drop=st.sampled_from([0.0, 0.1, 0.5]), max_satisfaction_drop=st.sampled_from([0.0, 0.5, 2.0]))
def test_no_single_user_moves_the_decision_alone(reports: list[Report], left_out: str, min_feedback: int,
                                                min_reporters: int, max_success_drop: float,
                                                max_satisfaction_drop: float) -> None:
    """Whatever the reports, taking one user's out (or putting them in) never turns an abort into
    a pass or a pass into an abort: at most it holds the window."""
    policy = CanaryAnalysis(min_requests=20, min_feedback=min_feedback, min_reporters=min_reporters,
                            max_success_drop=max_success_drop, max_satisfaction_drop=max_satisfaction_drop)
    with_them = outcome(judge(policy, *reported(reports)))
    without = outcome(judge(policy, *reported([report for report in reports if report[0] != left_out])))
    assert {with_them, without} != {"abort", "pass"}


def by_definition(policy: CanaryAnalysis, stable: dict[str, Rated], canary: dict[str, Rated],
                  allowed: float) -> str:
    """compare_outcomes as its docstring states it, by brute force."""
    def enough(s: dict[str, Rated], c: dict[str, Rated]) -> bool:
        return min(sum(r.reports for r in s.values()), sum(r.reports for r in c.values())) >= policy.min_feedback \
            and min(len(s), len(c)) >= policy.min_reporters

    def worse(s: dict[str, Rated], c: dict[str, Rated]) -> bool:
        return statistics.median(r.value for r in s.values()) - statistics.median(r.value for r in c.values()) > allowed

    if not enough(stable, canary):
        return "uncompared"
    verdict = worse(stable, canary)
    for user in stable.keys() | canary.keys():
        s = {u: r for u, r in stable.items() if u != user}
        c = {u: r for u, r in canary.items() if u != user}
        if (verdict and not enough(s, c)) or (enough(s, c) and worse(s, c) != verdict):
            return "held"
    return "worse" if verdict else "fine"


rated = st.dictionaries(st.sampled_from([f"u{n}" for n in range(12)]),
                        st.builds(Rated, st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0, 4.5, 5.0]), st.integers(1, 4)),
                        max_size=12)


@given(stable=rated, canary=rated, allowed=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
       min_feedback=st.integers(1, 8), min_reporters=st.integers(1, 5))
def test_the_leave_one_out_comparison_is_the_rule_it_states(stable: dict[str, Rated], canary: dict[str, Rated],
                                                            allowed: float, min_feedback: int,
                                                            min_reporters: int) -> None:
    policy = CanaryAnalysis(min_feedback=min_feedback, min_reporters=min_reporters)
    assert compare_outcomes(policy, stable, canary, allowed) == by_definition(policy, stable, canary, allowed)


@pytest.mark.parametrize(("text", "message"), [
    ("windows", "'windows' is not key=value"),
    ("windows=3,windows=4", "windows is given twice"),
    ("window_s=1", "window_s: Input should be greater than or equal to 5"),
    ("max_success_drop=lots", "max_success_drop: Input should be a valid number"),
    ("colour=blue", "colour: Extra inputs are not permitted"),
    ("windows=3,", "'' is not key=value"),
])
def test_a_bad_policy_is_refused_naming_the_item_or_field(text: str, message: str) -> None:
    with pytest.raises(Invalid, match="--analysis") as refused:
        parse_analysis(text)
    assert message in refused.value.message and "window_s" in (refused.value.hint or "")


def test_a_policy_from_the_command_line() -> None:
    assert parse_analysis(" window_s = 30, windows=2,max_success_drop=0.25") == CanaryAnalysis(
        window_s=30, windows=2, max_success_drop=0.25)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


USERS = ("olga", "ivan", "anna")


def alias(canary: int | None = 2, analysis: CanaryAnalysis | None = POLICY) -> Alias:
    return Alias(pool="main", roles=["user"], stable=1, canary=canary, canary_share=0.5, canary_analysis=analysis)


def test_the_gateway_gathers_each_versions_figures_and_acts_when_a_window_ends() -> None:
    clock = Clock()
    watch = CanaryWatch(clock)
    watch.served("codeword", 2, "olga", "before", status=200, failed=False, latency_s=1.0, ttft_s=None)
    assert watch.tick({"codeword": alias()}) == [] and watch.status("codeword", alias()) is not None  # a window begins
    for n in range(6):  # three users, two answers of each version each
        user = USERS[n % 3]
        watch.served("codeword", 1, user, f"stable-{n}", status=200, failed=False, latency_s=1.0, ttft_s=None)
        watch.served("codeword", 2, user, f"canary-{n}", status=200, failed=False, latency_s=None, ttft_s=0.2)
    watch.served("codeword", 2, "olga", "refused", status=429, failed=False, latency_s=0.0, ttft_s=None)
    watch.served("codeword", 3, "olga", "other", status=200, failed=False, latency_s=9.0, ttft_s=None)
    for n in range(6):  # the canary's answers are wrong, its clients say
        for version in ("stable", "canary"):
            answered, counted = watch.report(f"{version}-{n}", USERS[n % 3], version == "stable", None)
            assert counted and answered.version == (1 if version == "stable" else 2)
    with pytest.raises(NotFound):
        watch.report("stable-1", "mallory", False, None)  # another's answer is unknown to them
    with pytest.raises(Conflict, match="already been reported"):
        watch.report("stable-1", "ivan", False, None)  # one vote an answer
    with pytest.raises(NotFound):
        watch.report("refused", "olga", True, None)  # a refusal is no answer
    assert watch.report("before", "olga", False, None)[1] is False, "an answer from before the window does not count"
    status = watch.status("codeword", alias())
    assert status is not None and status["canary_figures"] == {
        "requests": 6, "users": 3, "reporters": 3, "error_rate": 0.0, "latency_p50_s": None, "ttft_p50_s": 0.2,
        "success_rate": 0.0, "satisfaction": None}
    clock.now = 9.0
    assert watch.tick({"codeword": alias()}) == []
    clock.now = 10.0
    [ended] = watch.tick({"codeword": alias()})
    assert ended.decision == "abort" and ended.verdict.failures == (
        "success rate 0% vs 100% (allowed -20%; medians of 3 and 3 users' own)",)
    assert "codeword v2 aborted against v1: success rate 0% vs 100%" in ended.detail()
    assert '"canary":{"requests":6' in ended.detail()


def test_a_canary_s_window_shows_before_the_gateway_s_first_tick_and_the_tick_keeps_it() -> None:
    """Asked right after the canary began (or the gateway restarted), before the watch's first tick:
    the window begins then, empty, a whole window left, and counts the answers that follow."""
    clock = Clock()
    watch = CanaryWatch(clock)
    status = watch.status("codeword", alias())
    assert status is not None and (status["canary"], status["passed_windows"], status["window_left_s"]) == \
        (2, 0, POLICY.window_s)
    assert status["canary_figures"]["requests"] == 0  # type: ignore[index]
    watch.served("codeword", 2, "olga", "a", status=200, failed=False, latency_s=1.0, ttft_s=None)
    clock.now = 1.0
    assert watch.tick({"codeword": alias()}) == []
    status = watch.status("codeword", alias())
    assert status is not None and status["canary_figures"]["requests"] == 1  # type: ignore[index]
    assert status["window_left_s"] == POLICY.window_s - 1


def test_one_users_flood_of_answers_pushes_out_only_their_own() -> None:
    watch = CanaryWatch(Clock())
    watch.served("codeword", 1, "olga", "olgas", status=200, failed=False, latency_s=1.0, ttft_s=None)
    for n in range(MAX_ANSWERS_PER_USER + 5):
        watch.served("codeword", 1, "mallory", f"m{n}", status=200, failed=False, latency_s=1.0, ttft_s=None)
    assert watch.report("olgas", "olga", True, None)[0].subject == "olga"
    with pytest.raises(NotFound):
        watch.report("m0", "mallory", True, None)
    assert watch.report(f"m{MAX_ANSWERS_PER_USER + 4}", "mallory", True, None)[0].subject == "mallory"


def test_a_changed_or_dropped_canary_starts_afresh_and_old_answers_expire() -> None:
    clock = Clock()
    watch = CanaryWatch(clock)
    watch.tick({"codeword": alias()})
    watch.served("codeword", 2, "olga", "a", status=200, failed=False, latency_s=1.0, ttft_s=None)
    watch.tick({"codeword": alias(canary=3)})  # another canary: the window starts over
    status = watch.status("codeword", alias(canary=3))
    assert status is not None and status["canary"] == 3 and status["canary_figures"]["requests"] == 0  # type: ignore[index]
    watch.tick({"codeword": alias(analysis=None)})
    assert watch.status("codeword", alias(analysis=None)) is None
    clock.now = ANSWER_TTL_S + 1
    with pytest.raises(NotFound):
        watch.report("a", "olga", True, None)
