"""The execution gate's decision on fixed held-out scores: an adapter better than its base model
passes, a worse one is refused with the numbers, one equal to the base passes (the rule is "no
worse than the base by more than --max-drop"), and --max-drop moves the line."""

from __future__ import annotations

import pytest

from finetune.rl.gate import PassAt1, verdict

BASE = PassAt1("base", [1, 2, 3], [0.5, 0.5, 0.5])


def adapter(*per_seed: float) -> PassAt1:
    return PassAt1("rl-coder", [4, 5, 6], list(per_seed))


def test_a_known_good_adapter_passes() -> None:
    assert verdict(BASE, adapter(0.75, 0.75, 0.5), max_drop=0.0) == []


def test_a_known_bad_adapter_is_refused_naming_both_scores() -> None:
    assert verdict(BASE, adapter(0.25, 0.25, 0.5), max_drop=0.0) == [
        "held-out pass@1 33.3% vs base 50.0%: may drop by 0% at most"]


def test_an_adapter_equal_to_its_base_passes() -> None:
    assert verdict(BASE, adapter(0.25, 0.75, 0.5), max_drop=0.0) == []


@pytest.mark.parametrize("per_seed,max_drop,passes", [
    ((0.25, 0.25, 0.25), 0.25, True),  # exactly max_drop below the base
    ((0.25, 0.25, 0.25), 0.125, False),
    ((0.0, 0.0, 0.0), 0.5, True),
    ((0.0, 0.0, 0.0), 0.25, False),
])
def test_max_drop_is_how_far_below_the_base_an_adapter_may_fall(per_seed: tuple[float, ...], max_drop: float,
                                                                passes: bool) -> None:
    assert (verdict(BASE, adapter(*per_seed), max_drop) == []) == passes


def test_the_mean_over_seeds_decides_not_the_best_seed() -> None:
    lucky = adapter(1.0, 0.0, 0.25)  # one seed far above the base, a mean below it
    assert lucky.mean < BASE.mean and verdict(BASE, lucky, max_drop=0.0)
