"""Online GRPO's parts: the run's spec, the steps' tasks, the update trainer (TRL's GRPOTrainer on a
tiny model, resumed step by step from its checkpoints) and what the worker accepts from it."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from pydantic import ValidationError
from safetensors.torch import load_file

from appliance.errors import ApplianceError
from appliance.rl.progress import PolicyProgress, PolicyStep, policy_line
from appliance.rl.runs import PolicySpec, RunSpec
from appliance.rl.tasks import Task
from finetune.rl.policy import copy_plain_file, read_result, step_tasks
from finetune.rl.policy_update import Group, UpdateSpec, checkpoint_dir, main, result_file, update_file
from tests.support.models import tiny_llama

GRPO = PolicySpec(policy="coder-grpo")


def test_a_grpo_run_trains_from_the_base_in_groups_without_corrections() -> None:
    assert RunSpec(tasks="t", base="demo", samples=4, rounds=0, grpo=GRPO).grpo == GRPO
    for wrong, why in (({"adapter": "coder"}, "give no adapter"), ({"rounds": 1}, "rounds must be 0"),
                       ({"samples": 1}, "at least 2 samples")):
        with pytest.raises(ValidationError, match=why):
            RunSpec(**{"tasks": "t", "base": "demo", "samples": 4, "rounds": 0, "grpo": GRPO, **wrong})
    for field, value in (("policy", "../x"), ("policy", "a\nb"), ("beta", 0), ("steps", 0), ("learning_rate", -1)):
        with pytest.raises(ValidationError, match=field):
            PolicySpec(**{"policy": "p", field: value})


def test_steps_take_the_training_tasks_in_turn() -> None:
    tasks = [Task(id=str(i), prompt="p", cases=[{"stdout": "1"}]) for i in range(5)]
    assert [t.id for t in step_tasks(tasks, 0, 2)] == ["0", "1"]
    assert [t.id for t in step_tasks(tasks, 2, 2)] == ["4", "0"]
    assert [t.id for t in step_tasks(tasks, 7, 9)] == ["0", "1", "2", "3", "4"]  # fewer tasks than asked: all


def spec(base: Path, step: int) -> UpdateSpec:
    groups = [Group(messages=[{"role": "user", "content": f"task {i}"}],
                    answers=["def f():\n    return 1\n", "nope", "x = 2", "y"], rewards=[1.0, 0.0, 0.5, -0.1],
                    ended=[True, True, False, True]) for i in range(2)]
    return UpdateSpec(base=base, step=step, beta=0.04, learning_rate=1e-3, lora_rank=4, max_answer_tokens=32,
                      groups=groups)


def test_each_update_resumes_the_step_before_and_moves_the_policy_away_from_the_base(
        tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = tiny_llama(tmp_path / "tiny", demo_model)
    work = tmp_path / "policy"
    work.mkdir()
    monkeypatch.setattr("finetune.rl.policy_update.die_with_parent", lambda: None)
    weights = []
    for step in range(2):
        update_file(work, step).write_text(spec(base, step).model_dump_json())
        assert main(work, step) == 0
        result = read_result(work, step)
        assert result is not None and result.step == step + 1 and result.train_tokens > 0
        assert result.reward_mean == pytest.approx(0.35) and result.reward_spread > 0
        weights.append(load_file(checkpoint_dir(work, step + 1) / "adapter_model.safetensors"))
        trained = json.loads((checkpoint_dir(work, step + 1) / "trainer_state.json").read_text())
        assert trained["global_step"] == step + 1  # the optimiser's state and step count carried on
    assert result.kl > 0  # the second update measured its distance from the base
    assert any(not (weights[0][name] == weights[1][name]).all() for name in weights[0])


def test_what_the_update_reports_is_checked_before_it_is_believed(tmp_path: Path) -> None:
    assert read_result(tmp_path, 0) is None  # not done yet
    checkpoint = checkpoint_dir(tmp_path, 1)
    checkpoint.mkdir(parents=True)
    good = {"step": 1, "loss": 0.1, "kl": 0.0, "reward_mean": 0.5, "reward_spread": 0.1, "train_tokens": 10,
            "seconds": 1.0}
    result_file(tmp_path, 0).write_text(json.dumps(good))
    with pytest.raises(ApplianceError, match="not step 1's"):  # its checkpoint is missing
        read_result(tmp_path, 0)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (checkpoint / name).write_text("{}")
    assert read_result(tmp_path, 0) is not None
    for forged in ({**good, "kl": math.nan}, {**good, "step": 2}, {**good, "kl": -1}, {**good, "extra": 1}, [good]):
        result_file(tmp_path, 0).write_text(json.dumps(forged))
        with pytest.raises(ApplianceError, match="not as asked|not step 1's"):
            read_result(tmp_path, 0)
    result_file(tmp_path, 0).unlink()
    os.symlink("/etc/passwd", result_file(tmp_path, 0))
    with pytest.raises(ApplianceError, match="not a plain file"):
        read_result(tmp_path, 0)
    # The adapter's files are copied out of the trainer's directory only as the plain files they must be.
    (checkpoint / "link").symlink_to("/etc/passwd")
    os.mkfifo(checkpoint / "pipe")
    for odd in ("link", "pipe"):
        with pytest.raises(ApplianceError, match="plain file|not a regular file"):
            copy_plain_file(checkpoint / odd, tmp_path / f"copied-{odd}")
        assert not (tmp_path / f"copied-{odd}").exists()
    copy_plain_file(checkpoint / "adapter_config.json", tmp_path / "copied")
    assert (tmp_path / "copied").read_text() == "{}"
    with pytest.raises(ValidationError, match="one reward and one ending"):
        Group(messages=[{"role": "user", "content": "x"}], answers=["a", "b"], rewards=[1.0], ended=[True, True])


def test_the_progress_line_names_the_step_the_version_and_the_figures() -> None:
    step = PolicyStep(step=0, version=1, generated_by="demo", answers=8, reward_mean=0.412, reward_spread=0.3,
                      pass_rate=0.25, kl=0.0012, loss=-0.1, train_tokens=900, sample_s=3.0, generate_s=8.0,
                      execute_s=1.0, update_s=9.0)
    progress = PolicyProgress(policy="coder-grpo", steps=8, done=[step], resumed_from="step 1 (policy v1)")
    assert policy_line(progress) == ("GRPO step 1/8, coder-grpo v1: reward 0.412 +/- 0.300, pass rate 25%, "
                                     "KL 0.0012 (resumed at step 1 (policy v1))")
    assert policy_line(PolicyProgress(policy="p", steps=2, done=[])).startswith("GRPO step 0/2, the base model")


def test_the_terminal_ui_shows_a_grpo_runs_last_step() -> None:
    from appliance.jobs import JobState
    from appliance.rl.progress import RunProgress, RunReport
    from tui.rl_runs import run_line

    step = PolicyStep(step=1, version=2, generated_by="coder-grpo-v1", answers=8, reward_mean=0.5, reward_spread=0.25,
                      pass_rate=0.5, kl=0.002, loss=0.0, train_tokens=900, sample_s=3.0, generate_s=8.0,
                      execute_s=1.0, update_s=9.0)
    progress = RunProgress(tasks=16, attempts_done=16, attempts_planned=24, passed=8, pass_rate=0.4,
                           first_pass_rate=0.5, mean_reward=0.5, queue_depth=0, workers=1, trajectory_segments=0,
                           policy=PolicyProgress(policy="coder-grpo", steps=3, done=[step]))
    run = RunReport(id=4, spec=RunSpec(tasks="starter", base="demo", samples=4, rounds=0, grpo=GRPO),
                    state=JobState.RUNNING, submitted="", started=None, finished=None, attempts=1, worker_pid=1,
                    message=None, progress=progress)
    assert run_line(run).startswith("Run 4: GRPO of coder-grpo on starter (train), groups of 4, 4 tasks a step; "
                                    "GRPO step 2/3, coder-grpo v2: reward 0.500 +/- 0.250, pass rate 50%, KL 0.0020")
