"""Evaluation sets (finetune.evalsets) and the gate's verdict (finetune.runner.gate_failures)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance.settings import FinetuneSettings
from finetune.evalsets import EvalSetError, matches, parse, score
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
    assert score(items, lambda messages: "yes" if messages[0]["content"] in "ab" else "no") == 0.5


def result(base_loss: float = 2.0, adapter_loss: float = 1.0, **sets: dict[str, float]) -> Result:
    return Result(adapter_dir=Path("a"), base_eval_loss=base_loss, adapter_eval_loss=adapter_loss, steps=1,
                  train_tokens=1, seconds=1.0, resumed_from=None, eval_sets=sets)


def test_gate_verdicts() -> None:
    gate = FinetuneSettings(gate_min_improvement=0.1, gate_min_scenario_score=0.5, gate_max_regression_drop=0.05)
    assert gate_failures(result(), gate) == []
    assert gate_failures(result(adapter_loss=1.95), gate)[0].startswith("held-out loss 1.9500 vs base 2.0000")
    assert gate_failures(result(scenarios={"base": 0.2, "adapter": 0.4}), gate)[0].startswith("scenario score 40%")
    assert gate_failures(result(scenarios={"base": 0.9, "adapter": 0.6}), gate)  # worse than the base
    assert gate_failures(result(regression={"base": 0.8, "adapter": 0.76}), gate) == []
    assert gate_failures(result(regression={"base": 0.8, "adapter": 0.7}), gate)[0].startswith("regression score 70%")
