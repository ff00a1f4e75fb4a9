"""The agent gate's figures (pass@1, pass^k, paired intervals), its verdict and record, the trials it
runs, and its command's bad paths. The episodes through a real gateway: tests/integration/test_environment.py."""

from __future__ import annotations

import itertools
import sys
from math import comb
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance import adapters
from appliance.adapters import AdapterRecord, Scores
from appliance.errors import Invalid
from appliance.home import Home
from appliance.jobs import Hyperparameters
from appliance.rl.episodes import Episode
from appliance.rl.tasks import RepositoryTask
from appliance.settings import Settings
from finetune.rl import episode_gate
from finetune.rl.episode_gate import Trials, judge, pass_hat, record, regression_check, run_trials
from tests.support.records import metrics
from tests.support.repository_tasks import CALC_TASK

NO_REGRESSION: tuple[str, list[str]] = ("regression: checked", [])


def trials(model: str, table: dict[str, list[bool]]) -> Trials:
    return Trials(model, table, [])


def test_pass_hat_k_is_the_chance_that_k_trials_drawn_all_passed() -> None:
    assert pass_hat(4, 4, 4) == 1.0 and pass_hat(3, 4, 4) == 0.0
    assert pass_hat(3, 4, 2) == pytest.approx(3 / 6)  # 3 of the 6 pairs pass together
    assert pass_hat(0, 5, 1) == 0.0
    for passed, total, k in ((5, 4, 1), (-1, 4, 1), (2, 4, 0), (2, 4, 5)):
        with pytest.raises(ValueError, match="pass\\^"):
            pass_hat(passed, total, k)


@given(st.lists(st.booleans(), min_size=1, max_size=12))
def test_pass_hat_1_is_pass_at_1_and_pass_hat_k_never_rises_with_k(outcomes: list[bool]) -> None:
    passed, total = sum(outcomes), len(outcomes)
    assert pass_hat(passed, total, 1) == pytest.approx(passed / total)
    chances = [pass_hat(passed, total, k) for k in range(1, total + 1)]
    assert all(later <= earlier + 1e-12 for earlier, later in itertools.pairwise(chances))
    # The estimate is the share of k-subsets of the trials that all passed.
    k = max(1, total // 2)
    subsets = list(itertools.combinations(outcomes, k))
    assert pass_hat(passed, total, k) == pytest.approx(sum(all(s) for s in subsets) / comb(total, k))


def test_a_better_adapter_passes_and_a_worse_one_fails_naming_both_figures() -> None:
    base = trials("base", {f"t{i}": [False, False, True, False] for i in range(6)})
    better = trials("coder", {f"t{i}": [True, True, True, i % 2 == 0] for i in range(6)})
    outcome = judge(base, better, 2, 0.0, NO_REGRESSION)
    assert outcome.failures == [] and outcome.pass_at_1.low > 0 and outcome.pass_hat_k.mean > 0
    lines = outcome.lines()
    assert lines[0] == "6 held-out tasks, 4 episodes each a model" and lines[-1] == "gate: passed"
    assert "base (base): pass@1 25.0%, pass^2 0.0%" in lines
    worse = judge(better, base, 2, 0.0, NO_REGRESSION)
    assert [f.split(" difference")[0] for f in worse.failures] == ["held-out episodes pass@1",
                                                                   "held-out episodes pass^2"]
    assert "gate: FAILED: held-out episodes pass@1 difference -" in worse.lines()[-1]


def test_reliability_is_judged_apart_from_the_average() -> None:
    # The same pass@1 (half of the episodes), but the adapter passes half of the tasks always and the
    # base every task half of the time: pass^4 tells them apart.
    base = trials("base", {f"t{i}": [True, False, True, False] for i in range(8)})
    steady = trials("coder", {f"t{i}": [i < 4] * 4 for i in range(8)})
    outcome = judge(base, steady, 4, 0.0, NO_REGRESSION)
    assert outcome.pass_at_1.mean == 0 and outcome.pass_hat_k.mean == pytest.approx(0.5)


def test_the_regression_check_and_different_tasks_are_failures() -> None:
    table = {"t0": [True], "t1": [False]}
    failing = ("regression (the shipped set): 40% with the adapter, 80% without", ["regression score 40% vs ..."])
    outcome = judge(trials("b", table), trials("a", table), 1, 0.0, failing)
    assert outcome.failures == ["regression score 40% vs ..."] and failing[0] in outcome.lines()
    with pytest.raises(Invalid, match="different tasks"):
        judge(trials("b", table), trials("a", {"t0": [True]}), 1, 0.0, NO_REGRESSION)


def registered(home: Home, eval_sets: dict[str, Scores], gate_failures: list[str]) -> None:
    with adapters.updating(home) as registry:
        registry.adapters.append(AdapterRecord(
            name="coder", version=1, base_model="demo", base_config_sha256="b", dataset="d", dataset_sha256="x",
            hyperparameters=Hyperparameters(), artifact="a/", state="registered",
            metrics=metrics().model_copy(update={"eval_sets": eval_sets, "gate_failures": gate_failures})))


def test_the_regression_check_reads_the_adapter_s_training(home: Home) -> None:
    registered(home, {}, [])
    said, failed = regression_check(home, "coder", 1)
    assert "trained without a regression set" in said and "has no regression score" in failed[0]
    shipped = Scores(base=0.8, adapter=0.4, shipped=True)
    with adapters.updating(home) as registry:
        found = registry.find("coder", 1)
        found.metrics.eval_sets["regression"] = shipped
        found.metrics.gate_failures = ["regression score 40% vs base 80% (the shipped set): may drop by 5% at most"]
    said, failed = regression_check(home, "coder", 1)
    assert said == "regression (the shipped set): 40% with the adapter, 80% without (from its training)"
    assert failed == ["regression score 40% vs base 80% (the shipped set): may drop by 5% at most"]


def test_the_outcome_is_recorded_on_the_version_and_replaces_an_earlier_verdict(home: Home) -> None:
    registered(home, {"regression": Scores(base=0.8, adapter=0.8)},
               ["held-out episodes pass@1 an earlier verdict", "held-out loss kept"])
    base = trials("base", {"t0": [False, True], "t1": [False, False]})
    adapter = trials("coder", {"t0": [True, True], "t1": [True, False]})
    record(home, "coder", 1, judge(base, adapter, 2, 0.0, NO_REGRESSION))
    found = adapters.load(home).find("coder", 1)
    scores = found.metrics.eval_sets
    at_1, at_2 = scores["held-out episodes pass@1"], scores["held-out episodes pass^2"]
    assert (at_1.base, at_1.adapter, at_1.base_per_seed, at_1.adapter_per_seed) == (0.25, 0.75, [0.0, 0.5], [1.0, 0.5])
    assert (at_2.base, at_2.adapter) == (0.0, 0.5) and at_2.difference_95 is not None
    assert found.metrics.gate_failures == ["held-out loss kept"], "the earlier agent verdict is replaced"


class FakeGenerator:
    closed: list[str] = []

    def __init__(self, settings: Settings, home: Home, model: str) -> None:
        self.model = model

    def close(self) -> None:
        FakeGenerator.closed.append(self.model)


class FakeEnvironment:
    def __init__(self, task: RepositoryTask, *_: Any) -> None:
        self.task = task

    def __enter__(self) -> FakeEnvironment:
        return self

    def __exit__(self, *_: Any) -> None:
        pass


class Entry:
    def __init__(self, id: str) -> None:
        self.id = id


def fake_episodes(monkeypatch: pytest.MonkeyPatch, fail_at: int | None = None) -> tuple[list[tuple[str, int]],
                                                                                        list[Episode]]:
    """Episodes that pass at seed 0 only (the `fail_at`th raises), and what was kept."""
    ran: list[tuple[str, int]] = []
    kept: list[Episode] = []

    def episode(task: RepositoryTask, generator: FakeGenerator, environment: FakeEnvironment, rl: Any, *,
                temperature: float, seed: int, **_: Any) -> Episode:
        ran.append((task.id, seed))
        if len(ran) == fail_at:
            raise RuntimeError("the gateway went away")
        passed = seed == 0
        return Episode(task=task.id, model=generator.model, turns=[], ended="submitted" if passed else "steps",
                       reason="-", reward=1.0 if passed else 0.0, tests_passed=2 if passed else 0, tests_total=2,
                       workspace_sha256=None, seconds=0.1)

    def keep(episode: Episode, artifacts: Any, home: Home) -> Entry:
        kept.append(episode)
        return Entry(f"e{len(kept)}")

    monkeypatch.setattr(episode_gate, "Generator", FakeGenerator)
    monkeypatch.setattr(episode_gate, "WorkspaceEnvironment", FakeEnvironment)
    monkeypatch.setattr(episode_gate, "run_episode", episode)
    monkeypatch.setattr("appliance.rl.episodes.keep", keep)
    FakeGenerator.closed = []
    return ran, kept


def test_each_task_gets_its_trials_with_seeds_in_order_and_every_episode_is_kept(
        home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    ran, kept = fake_episodes(monkeypatch)
    said: list[str] = []
    other = CALC_TASK.model_copy(update={"id": "calc-sub"})
    done = run_trials([CALC_TASK, other], "demo", 2, settings=Settings(), home=home, artifacts=None,  # type: ignore[arg-type]
                      task_set="calc", temperature=0.7, tool_choice="auto", extra_body=None, show=said.append)
    assert ran == [("calc-add", 0), ("calc-add", 1), ("calc-sub", 0), ("calc-sub", 1)]
    assert done.passed == {"calc-add": [True, False], "calc-sub": [True, False]}
    assert done.episodes == ["e1", "e2", "e3", "e4"] and all(e.task_set == "calc" for e in kept)
    assert said[0] == "demo: episode 1/4 (calc-add, seed 0): passed" and said[3].endswith("(calc-sub, seed 1): steps")
    assert FakeGenerator.closed == ["demo"]


def test_a_failing_episode_stops_the_trials_and_closes_the_client(home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    ran, kept = fake_episodes(monkeypatch, fail_at=2)
    with pytest.raises(RuntimeError, match="gateway went away"):
        run_trials([CALC_TASK], "demo", 3, settings=Settings(), home=home, artifacts=None,  # type: ignore[arg-type]
                   task_set="calc", temperature=0.7, tool_choice="auto", extra_body=None, show=lambda line: None)
    assert len(kept) == 1 and FakeGenerator.closed == ["demo"]


def test_the_command_refuses_bad_options_before_any_episode(home: Home, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from appliance.cli import main

    monkeypatch.setenv("APPLIANCE_HOME", str(home.root))
    for args, said in ((["--trials", "2", "--k", "3"], "--k 3: at most --trials (2)"),
                       (["--extra-body", "[1]"], "--extra-body: a JSON object"),
                       (["--extra-body", "{"], "--extra-body: not JSON at character 1"),
                       (["--extra-body", "[" * 100_000], "--extra-body: nested too deep"),
                       (["--tool-choice", "none"], "--tool-choice 'none': auto or required"),
                       ([], "adapter 'coder' is not deployed")):
        monkeypatch.setattr(sys, "argv", ["appliance", "rl", "episodes", "gate", "coder", "--tasks", "calc",
                                          "--base", "demo", *args])
        with pytest.raises(SystemExit) as ended:
            main()
        printed = capsys.readouterr()
        assert ended.value.code != 0 and said in " ".join((printed.out + printed.err).split()), (args, printed)
    assert not list(home.root.glob("**/episodes/*.json")), "no episode ran"
