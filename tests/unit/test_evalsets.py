"""Evaluation sets (finetune.evalsets) and the gate's verdict (finetune.runner.gate_failures)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance.adapters import Scores
from appliance.settings import FinetuneSettings
from finetune.evalsets import SHIPPED_REGRESSION, EvalSetError, matches, parse, score, with_shipped_regression
from finetune.runner import checked_scores, gate_failures
from finetune.train import Result, TrainingError, load_result


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
    assert failure.endswith("the spread over seeds is wider than that: add items or seeds")
    [failure] = gate_failures(result(), {"scenarios": Scores.over_seeds([0.1, 0.1], [0.9, 0.0])}, gate)
    assert failure.startswith("scenario score 45% (mean of 2 seeds, +/- 64%) (base 10%)")
    # The spread travels with the record (the admin API, `adapters show --json`) and reads back.
    shipped = Scores.over_seeds([0.5, 0.75], [0.5, 0.5], shipped=True)
    sent = shipped.model_dump()
    assert sent["base_spread"] == pytest.approx(0.1768, abs=1e-4) and sent["adapter_spread"] == 0.0
    assert Scores.model_validate(sent) == shipped
    assert shipped.line("regression") == "regression (shipped) 62% -> 50% (mean of 2 seeds, +/- 0%)"
    measured = Scores.over_seeds([0.5] * 3, [0.75] * 3).model_copy(update={"difference_95": (0.125, 0.375)})
    assert measured.line("held_out_pass@1").endswith("(mean of 3 seeds, +/- 0%), difference 95% [+12%, +38%]")
    # A record written before seeds were kept reads back as one score.
    assert Scores.model_validate({"base": 0.5, "adapter": 0.7}).line("scenarios") == "scenarios 50% -> 70%"


def test_the_shipped_regression_set_is_used_only_where_a_job_brings_none(tmp_path: Path) -> None:
    shipped = parse(SHIPPED_REGRESSION)
    assert len(shipped) >= 12 and all(item["messages"][-1]["role"] == "user" for item in shipped)
    chat = tmp_path / "chat"
    chat.mkdir()
    (chat / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    own = {"regression": [{"messages": [], "expect": "x", "match": "contains"}]}
    assert with_shipped_regression(own, "shipped", chat) == (own, False)
    assert with_shipped_regression({}, "none", chat) == ({}, False)
    sets, added = with_shipped_regression({"scenarios": []}, "shipped", chat)
    assert added and sets == {"scenarios": [], "regression": shipped}
    # A base with no chat template (plain text) cannot be asked questions: not after a whole training.
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 2048}))
    assert with_shipped_regression({}, "shipped", plain) == ({}, False)
    (plain / "chat_template.jinja").write_text("{{ messages }}")
    assert with_shipped_regression({}, "shipped", plain)[1]


def test_prompts_are_batched_by_length_within_the_token_budget() -> None:
    from finetune.train import SCORE_BATCH, SCORE_TOKENS, _batches

    prompts = [[0] * n for n in (5, 3000, 4, 9000, 6, *([7] * 40))]
    batches = _batches(prompts, padded=True)
    assert sorted(i for batch in batches for i in batch) == list(range(len(prompts)))
    for batch in batches:
        assert len(batch) <= SCORE_BATCH and len(batch) * max(len(prompts[i]) for i in batch) <= max(
            SCORE_TOKENS, max(len(prompts[i]) for i in batch))
    assert [3] in batches and [1] in batches  # the long ones alone: never padded to 32 times their length
    assert all(len(batch) == 1 for batch in _batches(prompts, padded=False))


def per_seed(base: object, adapter: object) -> dict[str, object]:
    return {"base": base, "adapter": adapter}


@pytest.mark.parametrize("reported", [
    {"regression": per_seed([0.5, 0.5], [float("nan"), 0.5])},  # NaN passes every comparison
    {"regression": per_seed([0.5, 0.5], [float("inf"), 0.5])},
    {"regression": per_seed([0.5, 0.5], [1.5, 0.5])},  # not a fraction
    {"regression": per_seed([0.5, 0.5], [-0.1, 0.5])},
    {"regression": per_seed([], [])},  # no seed at all
    {"regression": per_seed([0.5], [0.5])},  # fewer seeds than asked
    {"regression": per_seed([0.5] * 3_000_000, [0.5] * 3_000_000)},  # a registry bloated
    {"regression": per_seed(["0.5", "0.5"], [0.5, 0.5])},
    {"regression": per_seed([True, True], [0.5, 0.5])},
    {"regression": {"base": [0.5, 0.5]}},  # the adapter's left out
    {"regression": [0.5, 0.5]},
    {},  # the shipped set's verdict left out: the gate would skip it
    {"regression": per_seed([0.5, 0.5], [0.5, 0.5]), "scenarios": per_seed([1.0, 1.0], [1.0, 1.0])},  # not asked
], ids=["nan", "inf", "above-1", "negative", "empty", "short", "huge", "strings", "bools", "no-adapter", "list",
        "dropped", "extra"])
def test_scores_not_as_asked_fail_the_job_never_the_gate(reported: dict[str, object]) -> None:
    """The trainer runs sandboxed and is not trusted: what it reports must be what it was asked for
    (the sets given, a fraction a seed), or the job fails; nothing it writes reaches the registry."""
    forged = Result(adapter_dir=Path("a"), base_eval_loss=2.0, adapter_eval_loss=1.0, steps=1, train_tokens=1,
                    seconds=1.0, resumed_from=None, eval_sets=reported)  # type: ignore[arg-type]
    with pytest.raises(TrainingError, match="the trainer"):
        checked_scores(forged, {"regression": []}, seeds=2, shipped=True)


def test_scores_as_asked_are_kept_and_read_back() -> None:
    honest = Result(adapter_dir=Path("a"), base_eval_loss=2.0, adapter_eval_loss=1.0, steps=1, train_tokens=1,
                    seconds=1.0, resumed_from=None, eval_sets={"regression": per_seed([0.5, 1.0], [0.5, 0])})  # type: ignore[dict-item]
    [(kind, scores)] = checked_scores(honest, {"regression": []}, seeds=2, shipped=True).items()
    assert kind == "regression" and scores.shipped and scores.adapter == 0.25
    assert Scores.model_validate_json(scores.model_dump_json()) == scores
    with pytest.raises(ValueError):
        Scores.model_validate({"base": float("nan"), "adapter": 0.5})


@pytest.mark.parametrize("written", ["link", "directory", "not-json", "extra-key", "steps-text", "loss-list",
                                     "huge"])
def test_a_forged_result_file_fails_the_job(tmp_path: Path, written: str) -> None:
    good = {"adapter_dir": "x", "base_eval_loss": 2.0, "adapter_eval_loss": 1.0, "steps": 1, "train_tokens": 1,
            "seconds": 1.0, "resumed_from": None, "eval_sets": {}, "processes": 1}
    path = tmp_path / "result.json"
    if written == "link":
        (tmp_path / "elsewhere.json").write_text(json.dumps(good))
        path.symlink_to(tmp_path / "elsewhere.json")
    elif written == "directory":
        path.mkdir()
    elif written == "not-json":
        path.write_text("{")
    elif written == "huge":
        path.write_text(json.dumps({**good, "resumed_from": "x" * (2 << 20)}))
    else:
        changed = {"extra-key": {"owner": "root"}, "steps-text": {"steps": "1"},
                   "loss-list": {"adapter_eval_loss": [0.1]}}[written]
        path.write_text(json.dumps({**good, **changed}))
    with pytest.raises(TrainingError, match="result.json"):
        load_result(tmp_path)
    path.unlink() if path.is_symlink() or path.is_file() else path.rmdir()
    path.write_text(json.dumps(good))
    assert load_result(tmp_path).adapter_dir == tmp_path / "adapter"  # never where the file says
