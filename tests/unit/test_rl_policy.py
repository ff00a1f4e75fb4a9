"""Online GRPO's parts: the run's spec, the steps' tasks, the update trainer (TRL's GRPOTrainer on a
tiny model, resumed step by step from its checkpoints) and what the worker accepts from it."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError
from safetensors.torch import load_file

from appliance.adapters import AdapterRecord, Registry
from appliance.errors import Conflict, Invalid
from appliance.home import Home
from appliance.jobs import Hyperparameters
from appliance.rl.progress import PolicyProgress, PolicyStep, policy_line
from appliance.rl.runs import PolicySpec, RunSpec, check_policy_name
from appliance.rl.tasks import Task
from appliance.roles import Role
from appliance.settings import PoolSettings, Settings
from finetune.rl.policy import (
    POLICY_ROLES,
    PolicyTraining,
    UntrustedOutput,
    check_adapter_config,
    checked_result,
    copy_beneath,
    read_beneath,
    step_tasks,
)
from finetune.rl.policy_update import CHECKPOINTS, RESULT, RESUME_FILES, Group, UpdateSpec, main
from tests.support.models import tiny_llama
from tests.support.records import metrics

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


def spec(base: Path, step: int, work: Path) -> UpdateSpec:
    groups = [Group(messages=[{"role": "user", "content": f"task {i}"}],
                    answers=["def f():\n    return 1\n", "nope", "x = 2", "y"], rewards=[1.0, 0.0, 0.5, -0.1],
                    ended=[True, True, False, True]) for i in range(2)]
    return UpdateSpec(base=base, resume=work / f"trained-{step}" if step else None, output=work / f"step-{step}",
                      step=step, beta=0.04, learning_rate=1e-3, lora_rank=4, max_answer_tokens=32, groups=groups)


def test_each_update_resumes_the_step_before_and_moves_the_policy_away_from_the_base(
        tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = tiny_llama(tmp_path / "tiny", demo_model)
    work = tmp_path / "policy"
    work.mkdir()
    monkeypatch.setattr("finetune.rl.policy_update.die_with_parent", lambda: None)
    weights = []
    for step in range(2):
        asked = spec(base, step, work)
        asked.output.mkdir()
        (work / f"update-{step}.json").write_text(asked.model_dump_json())
        assert main(work / f"update-{step}.json") == 0
        result = checked_result(asked.output, step)
        assert result.step == step + 1 and result.train_tokens > 0 and math.isfinite(result.loss)
        where = (CHECKPOINTS, f"checkpoint-{step + 1}")
        check_adapter_config(read_beneath(asked.output, (*where, "adapter_config.json"), 1 << 16), 4)
        trained = work / f"trained-{step + 1}"  # what the worker copies out for the next update
        trained.mkdir()
        for name in RESUME_FILES:
            copy_beneath(asked.output, (*where, name), trained / name, 1 << 30)
        weights.append(load_file(trained / "adapter_model.safetensors"))
        state = json.loads((trained / "trainer_state.json").read_text())
        assert state["global_step"] == step + 1  # the optimiser's state and step count carried on
    assert result.kl > 0  # the second update measured its distance from the base
    assert any(not (weights[0][name] == weights[1][name]).all() for name in weights[0])
    with pytest.raises(ValidationError, match="resumes the trainer state"):
        UpdateSpec(**{**spec(base, 1, work).model_dump(), "resume": None})


def test_what_the_trainer_leaves_is_read_only_as_plain_files_of_bounded_size(tmp_path: Path) -> None:
    """The trainer is not trusted: every component of a path into its directory is opened without
    following a link, and only regular files of bounded size are read or copied."""
    work, elsewhere = tmp_path / "step-0", tmp_path / "elsewhere"
    (work / CHECKPOINTS / "checkpoint-1").mkdir(parents=True)
    (elsewhere / "checkpoint-1").mkdir(parents=True)
    (elsewhere / "checkpoint-1" / "adapter_model.safetensors").write_bytes(b"another's weights")
    with pytest.raises(UntrustedOutput, match="not a plain file"):
        checked_result(work, 0)  # not done
    good = {"step": 1, "loss": 0.1, "kl": 0.0, "train_tokens": 10, "seconds": 1.0}
    (work / RESULT).write_text(json.dumps(good))
    assert checked_result(work, 0).step == 1
    for forged in ({**good, "kl": math.nan}, {**good, "step": 2}, {**good, "kl": -1}, {**good, "extra": 1}, [good],
                   {**good, "loss": 1e300}):
        (work / RESULT).write_text(json.dumps(forged))
        with pytest.raises(UntrustedOutput, match="not as asked|reported step 2"):
            checked_result(work, 0)
    (work / RESULT).unlink()
    (work / RESULT).symlink_to("/etc/passwd")
    with pytest.raises(UntrustedOutput, match="not a plain file"):
        checked_result(work, 0)
    # A link anywhere on the way, a pipe, a file too large: refused, nothing copied.
    shutil.rmtree(work / CHECKPOINTS)
    (work / CHECKPOINTS).symlink_to(elsewhere)
    with pytest.raises(UntrustedOutput, match="not a plain file"):
        copy_beneath(work, (CHECKPOINTS, "checkpoint-1", "adapter_model.safetensors"), tmp_path / "copy", 1 << 20)
    (work / CHECKPOINTS).unlink()
    (work / CHECKPOINTS / "checkpoint-1").mkdir(parents=True)
    os.mkfifo(work / CHECKPOINTS / "checkpoint-1" / "optimizer.pt")
    (work / CHECKPOINTS / "checkpoint-1" / "adapter_model.safetensors").write_bytes(b"x" * 2048)
    for name, limit in (("optimizer.pt", 1 << 20), ("adapter_model.safetensors", 1024)):
        with pytest.raises(UntrustedOutput, match="not a regular file of at most"):
            copy_beneath(work, (CHECKPOINTS, "checkpoint-1", name), tmp_path / "copy", limit)
        assert not (tmp_path / "copy").exists()
    # The adapter's config is the LoRA asked for, and nothing more.
    good_config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    check_adapter_config(json.dumps(good_config).encode(), 4)
    for bad in ({**good_config, "r": 64}, {**good_config, "peft_type": "IA3"},
                {**good_config, "modules_to_save": ["lm_head"]}):
        with pytest.raises(UntrustedOutput, match="not as asked"):
            check_adapter_config(json.dumps(bad).encode(), 4)
    with pytest.raises(UntrustedOutput, match="not as asked"):
        check_adapter_config(b"\xff not json", 4)
    with pytest.raises(ValidationError, match="one reward and one ending"):
        Group(messages=[{"role": "user", "content": "x"}], answers=["a", "b"], rewards=[1.0], ended=[True, True])


def test_a_trainer_log_made_a_link_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    from finetune.runner import train_in_child
    from finetune.train import TrainingError

    target = tmp_path / "precious"
    target.write_text("kept\n")
    (tmp_path / "train.log").symlink_to(target)
    with pytest.raises(TrainingError, match="cannot be opened as a plain file"):
        train_in_child(tmp_path, [sys.executable, "-c", "print('written')"], lambda progress: None,
                       lambda pid: None, lambda: None, limit_s=60)
    assert target.read_text() == "kept\n"


def test_a_policy_trains_only_a_name_all_of_whose_versions_are_its_own(home: Home) -> None:
    training = PolicyTraining.__new__(PolicyTraining)  # the name rules only
    training.grpo = GRPO
    registry = Registry(adapters=[AdapterRecord(
        name="coder-grpo", version=1, base_model="demo", base_config_sha256="b", dataset="rl-run-1",
        dataset_sha256="x", hyperparameters=Hyperparameters(method="grpo"), metrics=metrics(), artifact="a/",
        state="registered")])
    with pytest.raises(Conflict, match="versions this run did not train \\(v1\\)"):
        training._check_name(set(), registry)  # a forged tag is not enough: the files must be the run's
    training._check_name({1}, registry)
    registry.deploy("coder-grpo", 1, "main", POLICY_ROLES)
    training._check_name({1}, registry)
    registry.aliases["coder-grpo"].roles = [Role.USER]  # an operator served it to users meanwhile
    with pytest.raises(Conflict, match="was changed while the run trained it"):
        training._check_name({1}, registry)
    settings = Settings(pools=[PoolSettings(name="main", served_model_name="qwen-base")])
    with pytest.raises(Invalid, match="is a served model's name"):
        check_policy_name(RunSpec(tasks="t", base="qwen-base", samples=2, rounds=0,
                                  grpo=PolicySpec(policy="qwen-base")), settings, home)


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
