"""The execution gate's decision on fixed held-out results: the adapter's pass@1 less the base
model's, per task over every seed and sample, with a 95 % interval from a bootstrap paired by task;
it passes only when the interval's lower end is at least -(--max-drop). A known-good adapter
passes, a known-bad one is refused with the numbers, and noise the size of the difference does not
pass an adapter that gained nothing."""

from __future__ import annotations

import pytest

from finetune.rl.gate import PassAt1, difference, verdict

TASKS = [f"HumanEval/{n}" for n in range(33)]  # about HumanEval's held-out fifth


def measured(model: str, *seeds: dict[str, float]) -> PassAt1:
    return PassAt1(model, list(range(len(seeds))), list(seeds))


def rates(passing: set[int], rate: float = 1.0) -> dict[str, float]:
    return {task: rate if n in passing else 0.0 for n, task in enumerate(TASKS)}


BASE = measured("base", rates(set(range(0, 10))), rates(set(range(0, 11))), rates(set(range(1, 10))))


def test_a_known_good_adapter_passes_with_its_interval_above_zero() -> None:
    good = measured("rl-coder", *(rates(set(range(0, 20))) for _ in range(3)))
    gain = difference(BASE, good)
    assert 0.25 < gain.mean < 0.35 and 0 < gain.low < gain.mean < gain.high and gain.tasks == 33
    assert verdict(gain, max_drop=0.0) == []


def test_a_known_bad_adapter_is_refused_naming_the_interval() -> None:
    bad = measured("rl-coder", *(rates(set(range(0, 3))) for _ in range(3)))
    gain = difference(BASE, bad)
    [failure] = verdict(gain, max_drop=0.0)
    assert gain.high < 0 and failure.startswith("held-out pass@1 difference -21.2% (95% interval [")
    assert failure.endswith("paired bootstrap over 33 tasks): its lower end must be at least +0%")


def test_an_adapter_that_gained_nothing_does_not_pass_a_zero_margin_but_passes_a_looser_one() -> None:
    same = measured("rl-coder", *BASE.per_task)
    gain = difference(BASE, same)
    assert gain.mean == 0 and gain.low == gain.high == 0  # paired: identical answers, no noise at all
    noisy = measured("rl-coder", rates(set(range(0, 10)) ^ {3, 20}), rates(set(range(0, 11)) ^ {4, 25}),
                     rates(set(range(1, 10)) ^ {5, 30}))
    gain = difference(BASE, noisy)
    assert gain.low < 0 < gain.high and verdict(gain, max_drop=0.0)  # luck either way: not shown better
    assert verdict(gain, max_drop=0.2) == []


def test_the_interval_is_reproducible_and_a_lucky_seed_does_not_decide() -> None:
    lucky = measured("rl-coder", rates(set(range(0, 33))), rates(set()), rates(set()))  # one seed far above
    gain = difference(BASE, lucky)
    assert gain == difference(BASE, lucky) and gain.mean > 0 and verdict(gain, max_drop=0.0)


@pytest.mark.parametrize("other", [["HumanEval/0"], TASKS + ["HumanEval/99"]])
def test_different_tasks_are_refused(other: list[str]) -> None:
    from appliance.errors import Conflict

    with pytest.raises(Conflict, match="different tasks"):
        difference(BASE, measured("rl-coder", dict.fromkeys(other, 1.0)))
