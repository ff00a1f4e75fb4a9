"""Evaluation sets (finetune.evalsets) and the gate's verdict (finetune.runner.gate_failures)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance.adapters import Scores
from appliance.settings import FinetuneSettings
from finetune.evalsets import SHIPPED_REGRESSION, EvalSetError, matches, parse, score, with_shipped_regression
from finetune.runner import gate_failures
from finetune.train import Result


def write(path: Path, *items: object) -> Path:
    path.write_text("".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in items))
    return path


def test_items_take_prompt_or_messages_and_default_to_contains(tmp_path: Path) -> None:
    items = parse(write(tmp_path / "s.jsonl", {"prompt": "Capital of France?", "expect": "Paris"},
                        {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
                         "expect": "^4$", "match": "regex"}))
    assert items[0] == {"messages": [{"role": "user", "content": "Capital of France?"}], "expect": "Paris",
                        "match": "contains"}
    assert items[1]["match"] == "regex" and len(items[1]["messages"]) == 2


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", ":2: not JSON"),
    ('["a list"]', ":2: an item is a JSON object"),
    ('{"expect": "x"}', ":2: needs a non-empty 'prompt' or 'messages'"),
    ('{"prompt": "hi", "expect": ""}', ":2: 'expect' must be a non-empty string"),
    ('{"prompt": "hi", "expect": "x", "match": "fuzzy"}', ":2: 'match' must be one of exact, contains, regex"),
    ('{"prompt": "hi", "expect": "(", "match": "regex"}', ":2: 'expect' is not a valid regular expression"),
    ('{"messages": [{"role": "assistant", "content": "x"}], "expect": "x"}', ":2: messages: the last turn"),
])
def test_bad_lines_are_named(tmp_path: Path, line: str, message: str) -> None:
    path = write(tmp_path / "s.jsonl", {"prompt": "fine", "expect": "x"}, line)
    with pytest.raises(EvalSetError, match=f"{path}{message}"):
        parse(path)


def test_empty_set_is_refused(tmp_path: Path) -> None:
    with pytest.raises(EvalSetError, match="no items"):
        parse(write(tmp_path / "s.jsonl", ""))


def test_matching_and_scores() -> None:
    assert matches("  Paris ", {"expect": "Paris", "match": "exact"})
    assert not matches("Paris, France", {"expect": "Paris", "match": "exact"})
    assert matches("It is PARIS.", {"expect": "paris", "match": "contains"})
    assert matches("answer: 42", {"expect": r"\b42\b", "match": "regex"})
    items = [{"messages": [{"role": "user", "content": q}], "expect": "yes", "match": "contains"} for q in "abcd"]
    assert score(items, ["yes", "yes", "no", "no"]) == 0.5
    with pytest.raises(ValueError, match="3 answers for 4 items"):
        score(items, ["yes", "yes", "no"])


def result(base_loss: float = 2.0, adapter_loss: float = 1.0) -> Result:
    return Result(adapter_dir=Path("a"), base_eval_loss=base_loss, adapter_eval_loss=adapter_loss, steps=1,
                  train_tokens=1, seconds=1.0, resumed_from=None)


def test_gate_verdicts() -> None:
    gate = FinetuneSettings(gate_min_improvement=0.1, gate_min_scenario_score=0.5, gate_max_regression_drop=0.05)

    def failures(base_loss: float = 2.0, adapter_loss: float = 1.0, **sets: tuple[list[float], list[float]]
                 ) -> list[str]:
        scores = {kind: Scores.over_seeds(*per_seed) for kind, per_seed in sets.items()}
        return gate_failures(result(base_loss, adapter_loss), scores, gate)

    assert failures() == []
    assert failures(adapter_loss=1.95)[0].startswith("held-out loss 1.9500 vs base 2.0000")
    assert failures(scenarios=([0.2], [0.4]))[0].startswith("scenario score 40% (base 20%)")
    assert failures(scenarios=([0.9], [0.6]))  # worse than the base
    assert failures(regression=([0.8], [0.76])) == []
    assert failures(regression=([0.8], [0.7]))[0].startswith("regression score 70% vs base 80%")


def test_the_gate_judges_the_mean_over_seeds_and_records_the_spread() -> None:
    gate = FinetuneSettings(gate_max_regression_drop=0.05, gate_min_scenario_score=0.5)
    # One unlucky seed does not fail an adapter whose mean holds...
    steady = Scores.over_seeds([0.8, 0.8, 0.8], [0.9, 0.6, 0.9])
    assert steady.adapter == pytest.approx(0.8) and steady.adapter_spread == pytest.approx(0.1732, abs=1e-4)
    assert gate_failures(result(), {"regression": steady}, gate) == []
    # ...and one lucky seed does not pass one whose mean falls.
    [failure] = gate_failures(result(), {"regression": Scores.over_seeds([0.8, 0.8, 0.8], [0.9, 0.5, 0.5])}, gate)
    assert failure.startswith("regression score 63% (mean of 3 seeds, +/- 23%) vs base 80%")
    [failure] = gate_failures(result(), {"scenarios": Scores.over_seeds([0.1, 0.1], [0.9, 0.0])}, gate)
    assert failure.startswith("scenario score 45% (mean of 2 seeds, +/- 64%) (base 10%)")
    # The spread travels with the record (the admin API, `adapters show --json`) and reads back.
    shipped = Scores.over_seeds([0.5, 0.75], [0.5, 0.5], shipped=True)
    sent = shipped.model_dump()
    assert sent["base_spread"] == pytest.approx(0.1768, abs=1e-4) and sent["adapter_spread"] == 0.0
    assert Scores.model_validate(sent) == shipped
    assert shipped.line("regression") == "regression (shipped) 62% -> 50% (mean of 2 seeds, +/- 0%)"
    # A record written before seeds were kept reads back as one score.
    assert Scores.model_validate({"base": 0.5, "adapter": 0.7}).line("scenarios") == "scenarios 50% -> 70%"


def test_the_shipped_regression_set_is_used_only_where_a_job_brings_none() -> None:
    shipped = parse(SHIPPED_REGRESSION)
    assert len(shipped) >= 12 and all(item["messages"][-1]["role"] == "user" for item in shipped)
    own = {"regression": [{"messages": [], "expect": "x", "match": "contains"}]}
    assert with_shipped_regression(own, "shipped") == (own, False)
    assert with_shipped_regression({}, "none") == ({}, False)
    sets, added = with_shipped_regression({"scenarios": []}, "shipped")
    assert added and sets == {"scenarios": [], "regression": shipped}
