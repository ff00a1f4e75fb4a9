"""LoRA and QLoRA training through the CLI on a tiny model made here (CPU): the held-out loss
drops, the gate passes or fails by the setting, the adapter is registered and audited, and a
killed run resumes from its checkpoint."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from appliance.adapters import load
from appliance.home import Home
from appliance.jobs import Hyperparameters, Phase, Progress
from audit import read_records
from tests.support.appliances import APPLIANCE
from tests.support.models import tiny_llama
from tests.support.processes import python_sleeper


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> tuple[dict[str, str], Path]:
    root = tmp_path_factory.mktemp("ft")
    model = tiny_llama(root / "tiny", demo_model)
    home = Home(root / "home").ensure()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")},
           "APPLIANCE_HOME": str(home.root), "COLUMNS": "200"}
    rows = [{"messages": [{"role": "user", "content": f"What is the code for item {i}?"},
                          {"role": "assistant", "content": f"The code for item {i} is ZEBRA."}]} for i in range(60)]
    data = root / "codes.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    added = subprocess.run([APPLIANCE, "data", "add", str(data), "--name", "codes", "--model", str(model)],
                           env=env, capture_output=True, text=True)
    assert added.returncode == 0, added.stderr
    return env, model


def without_shipped_set(env: dict[str, str]) -> dict[str, str]:
    """For a job whose test is not about forgetting: the shipped regression set (32 prompts over 3
    seeds, answered by base and adapter: 20-25 s on the tiny model, minutes on the demo) is skipped."""
    return {**env, "APPLIANCE_FINETUNE__REGRESSION_SET": "none"}


def finetune(env: dict[str, str], model: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([APPLIANCE, "finetune", "run", "--data", "codes", "--base", str(model), "--lr", "0.01",
                           "--batch-size", "8", *extra], env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.integration
def test_lora_lowers_held_out_loss_and_is_registered(workspace: tuple[dict[str, str], Path]) -> None:
    env, model = workspace
    result = finetune(without_shipped_set(env), model, "--name", "codes-lora", "--max-steps", "20")
    assert result.returncode == 0, result.stderr
    assert "gate: passed" in result.stdout
    home = Home(Path(env["APPLIANCE_HOME"]))
    [record] = [r for r in load(home).adapters if r.name == "codes-lora"]
    assert record.state == "registered" and record.version == 1
    assert record.metrics.adapter_eval_loss < record.metrics.base_eval_loss
    stored = home.root / "artifacts" / record.artifact
    assert (stored / "adapter_config.json").is_file() and (stored / "adapter_model.safetensors").is_file()
    assert ("adapter.train", "allowed") in [(r["action"], r["outcome"]) for r in read_records(home.audit)]


@pytest.mark.integration
def test_qlora_runs_on_the_cpu(workspace: tuple[dict[str, str], Path]) -> None:
    env, model = workspace
    result = finetune(without_shipped_set(env), model, "--name", "codes-qlora", "--max-steps", "8", "--qlora")
    assert result.returncode == 0, result.stderr
    [record] = [r for r in load(Home(Path(env["APPLIANCE_HOME"]))).adapters if r.name == "codes-qlora"]
    assert record.hyperparameters.qlora and record.metrics.adapter_eval_loss < record.metrics.base_eval_loss


@pytest.mark.integration
def test_an_agent_s_episodes_train_in_both_trainers(workspace: tuple[dict[str, str], Path], tmp_path: Path) -> None:
    """Rows that offer tools (as `rl episodes export` writes them) import, and train in TRL's
    trainer and in the sharded loop (which answers are learned: tests/unit/test_tool_rows.py)."""
    env, model = workspace
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"item": {"type": "integer"}}, "required": ["item"]}}}]
    rows = [{"tools": tools, "messages": [
        {"role": "user", "content": f"What is the code for item {i}?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "lookup", "arguments": json.dumps({"item": i})}}]},
        {"role": "tool", "tool_call_id": "c", "content": f"item {i}: noise {i * 7919 % 1000}"},
        {"role": "assistant", "content": f"The code for item {i} is ZEBRA."}]} for i in range(40)]
    data = tmp_path / "calls.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    added = subprocess.run([APPLIANCE, "data", "add", str(data), "--name", "calls", "--model", str(model)],
                           env=env, capture_output=True, text=True)
    assert added.returncode == 0, added.stderr
    for strategy in ("auto", "fsdp"):
        trained = subprocess.run([APPLIANCE, "finetune", "run", "--data", "calls", "--base", str(model), "--lr", "0.01",
                                  "--batch-size", "4", "--max-steps", "4", "--name", f"calls-{strategy}"],
                                 env={**without_shipped_set(env), "APPLIANCE_FINETUNE__STRATEGY": strategy},
                                 capture_output=True, text=True, timeout=600)
        assert trained.returncode == 0, trained.stdout + trained.stderr
        [record] = [r for r in load(Home(Path(env["APPLIANCE_HOME"]))).adapters if r.name == f"calls-{strategy}"]
        assert record.metrics.adapter_eval_loss < record.metrics.base_eval_loss


@pytest.mark.integration
def test_gate_scores_evaluation_sets_and_refuses_below_its_thresholds(workspace: tuple[dict[str, str], Path],
                                                          tmp_path: Path) -> None:
    env, model = workspace
    scenarios, regression = tmp_path / "scenarios.jsonl", tmp_path / "regression.jsonl"
    scenarios.write_text("".join(json.dumps({"prompt": f"What is the code for item {i}?", "expect": "ZEBRA"}) + "\n"
                                 for i in range(3)))
    regression.write_text(json.dumps({"messages": [{"role": "user", "content": "Say hi"}], "expect": ".*",
                                      "match": "regex"}) + "\n")
    demanding = {**env, "APPLIANCE_FINETUNE__GATE_MIN_SCENARIO_SCORE": "1.0",
                 "APPLIANCE_FINETUNE__GATE_MIN_IMPROVEMENT": "0.99"}
    result = finetune(demanding, model, "--name", "codes-sets", "--max-steps", "4", "--scenarios", str(scenarios),
                      "--regression", str(regression))
    [record] = [r for r in load(Home(Path(env["APPLIANCE_HOME"]))).adapters if r.name == "codes-sets"]
    assert result.returncode == 1 and record.state == "failed-gate"
    assert "failed the evaluation gate: held-out loss" in result.stderr  # not 99 % lower after four steps
    sets = record.metrics.eval_sets
    # Each set answered over the settings' 3 seeds (sampled); thresholds on the mean, the spread kept.
    assert set(sets) == {"scenarios", "regression"} and not sets["regression"].shipped
    assert sets["regression"].base_per_seed == sets["regression"].adapter_per_seed == [1.0, 1.0, 1.0]
    assert sets["regression"].adapter_spread == 0.0 and len(sets["scenarios"].adapter_per_seed) == 3
    assert 0 <= sets["scenarios"].base <= 1 and 0 <= sets["scenarios"].adapter <= 1
    if sets["scenarios"].adapter < 1.0:  # four steps rarely teach a random model the answer
        assert "scenario score" in result.stderr
    # The trainer reported each of the gate's evaluations (2 sets x 3 seeds); then the runner, registering.
    [report] = Path(env["APPLIANCE_HOME"], "finetune").glob("codes-sets-*/progress.json")
    progress = Progress.model_validate_json(report.read_text())
    assert (progress.phase, progress.evaluations, progress.evaluations_total, progress.step) == \
        (Phase.REGISTERING, 6, 6, 4)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "hi", "expect": "x"}) + "\n" + json.dumps({"prompt": "hi"}) + "\n")
    refused = finetune(env, model, "--name", "codes-bad", "--max-steps", "2", "--scenarios", str(bad))
    assert refused.returncode == 1 and f"{bad}:2: 'expect' must be a non-empty string" in refused.stderr


@pytest.mark.integration
def test_two_processes_train_one_adapter(workspace: tuple[dict[str, str], Path]) -> None:
    """torchrun with two CPU processes (gloo) stands in for two GPUs: DDP (chosen: sharding is the
    default; tests/integration/test_finetune_sharded.py) inside the sandbox, whose own loopback
    device carries their rendezvous."""
    env, model = workspace
    ddp = {**without_shipped_set(env), "APPLIANCE_FINETUNE__PROCESSES": "2", "APPLIANCE_FINETUNE__STRATEGY": "ddp"}
    result = finetune(ddp, model, "--name", "codes-ddp", "--max-steps", "4")
    assert result.returncode == 0, result.stderr
    [record] = [r for r in load(Home(Path(env["APPLIANCE_HOME"]))).adapters if r.name == "codes-ddp"]
    assert record.metrics.processes == 2 and record.metrics.steps == 4


@pytest.mark.integration
def test_killed_training_resumes_from_its_checkpoint(workspace: tuple[dict[str, str], Path]) -> None:
    env, model = workspace
    command = [APPLIANCE, "finetune", "run", "--data", "codes", "--base", str(model), "--lr", "0.01",
               "--batch-size", "2", "--name", "codes-resumed", "--max-steps", "30", "--save-steps", "5"]
    checkpoints = Path(env["APPLIANCE_HOME"]) / "finetune"
    env = without_shipped_set(env)
    killed = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not list(checkpoints.glob("codes-resumed-*/checkpoints/checkpoint-*/trainer_state.json")):
        assert killed.poll() is None and time.monotonic() < deadline, "no checkpoint before the run ended"
        time.sleep(0.2)
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    resumed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from checkpoint-" in resumed.stdout and "30 steps" in resumed.stdout


@pytest.mark.integration
def test_a_stale_pid_is_neither_taken_for_a_live_worker_nor_killed_as_a_trainer(tmp_path: Path) -> None:
    """After a reboot the numbers a dead worker recorded may belong to anything, this worker included."""
    from finetune.runner import end_stale_trainer
    from finetune.worker import worker_alive

    job_dir, elsewhere = tmp_path / "job-1", tmp_path / "engine"
    job_dir.mkdir()
    elsewhere.mkdir()
    other = subprocess.Popen(["sleep", "60"], cwd=elsewhere, start_new_session=True)
    worker = python_sleeper("finetune.worker")
    trainer = subprocess.Popen(["sleep", "60"], cwd=job_dir, start_new_session=True)
    try:
        assert not worker_alive(os.getpid()) and not worker_alive(other.pid) and not worker_alive(None)
        assert worker_alive(worker.pid)
        end_stale_trainer(other.pid, job_dir)  # a number reused by another program's group
        assert other.poll() is None, "not the job's trainer: left alone"
        end_stale_trainer(trainer.pid, job_dir)
        assert trainer.wait(10) == -signal.SIGKILL
    finally:
        for process in (other, worker, trainer):
            process.kill()
            process.wait()


@pytest.mark.integration
def test_a_job_on_a_dataset_changed_in_the_store_fails_and_is_audited(workspace: tuple[dict[str, str], Path],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker re-hashes the dataset it reads back; a changed one fails the job
    before any training, and the job's outcome is in the audit log."""
    from appliance import jobs
    from appliance.datasets import PREFIX, load_registry
    from appliance.settings import load_settings
    from finetune.worker import work_one

    env, model = workspace
    home = Home(Path(env["APPLIANCE_HOME"]))
    monkeypatch.setenv("APPLIANCE_HOME", str(home.root))
    stored = home.root / "artifacts" / f"{PREFIX}{load_registry(home)['codes']}" / "train.jsonl"
    original = stored.read_bytes()
    stored.chmod(0o600)
    stored.write_bytes(original.replace(b"ZEBRA", b"EVIL!", 1))
    try:
        job = jobs.submit(home, name="poisoned", data="codes", base=str(model), hyperparameters=Hyperparameters(),
                          eval_sets={})
        ended = work_one(home, load_settings(home.settings_file))
    finally:
        stored.write_bytes(original)
        stored.chmod(0o400)
    assert ended is not None and ended.id == job.id and ended.state == "failed"
    assert "dataset 'codes' in the artifact store was changed" in (ended.message or "")
    [record] = [r for r in read_records(home.audit) if r["action"] == "finetune.job"]
    assert record["outcome"] == "error" and "was changed" in record["error"]
    assert record["client"] == record["username"] == "finetune-worker" and record["target"]["kind"] == "job"


def test_a_diverged_run_fails_the_gate_and_its_metrics_still_read_back() -> None:
    from appliance.adapters import AdapterMetrics
    from appliance.settings import FinetuneSettings
    from finetune.runner import gate_failures
    from finetune.train import Result
    from tests.support.records import metrics

    nan = float("nan")
    diverged = Result(adapter_dir=Path("adapter"), base_eval_loss=2.0, adapter_eval_loss=nan, steps=4,
                      train_tokens=64, seconds=1.0, resumed_from=None)
    [failure] = gate_failures(diverged, {}, FinetuneSettings())
    assert "not a number (training diverged)" in failure
    sent = metrics(adapter_eval_loss=nan).model_dump_json()  # as the admin API answers it
    assert '"NaN"' in sent and math.isnan(AdapterMetrics.model_validate_json(sent).adapter_eval_loss)


def test_an_adapter_holding_a_symbolic_link_is_not_registered(tmp_path: Path, home: Home) -> None:
    """The trainer is sandboxed; the worker that copies its adapter to the store is not: a link the
    trainer planted must not make the worker copy a file of its choosing."""
    from appliance.adapters import AdapterState
    from appliance.artifacts import LocalStore
    from appliance.errors import IntegrityError
    from finetune.adapters import register
    from tests.support.records import metrics

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapter_model.safetensors").symlink_to(home.secrets)
    with pytest.raises(IntegrityError, match="symbolic link"):
        register(home, LocalStore(tmp_path / "store"), adapter, name="a", base_model="demo", base_config_sha256="x",
                 dataset="d", dataset_sha256="y", hyperparameters=Hyperparameters(), metrics=metrics(),
                 state=AdapterState.REGISTERED)
    assert load(home).adapters == [] and not (tmp_path / "store" / "adapters").exists()


@pytest.mark.integration
def test_forgetting_is_caught_by_the_shipped_regression_set(workspace: tuple[dict[str, str], Path],
                                                            demo_model: Path) -> None:
    """The demo model taught to answer every question with a code forgets what it knew: the job
    brings no regression set, so the shipped one (answered over 3 sampled seeds) fails the gate.
    (Batches of 4: the 12 steps at a high rate are what make it forget.)"""
    env, _ = workspace
    result = finetune(env, demo_model, "--name", "codes-forgets", "--max-steps", "12", "--batch-size", "4")
    [record] = [r for r in load(Home(Path(env["APPLIANCE_HOME"]))).adapters if r.name == "codes-forgets"]
    assert result.returncode == 1 and record.state == "failed-gate", result.stderr
    shipped = record.metrics.eval_sets["regression"]
    assert shipped.shipped and len(shipped.base_per_seed) == len(shipped.adapter_per_seed) == 3
    assert shipped.base >= 0.5 and shipped.adapter < shipped.base - 0.05  # it knew the answers, and lost them
    [failure] = [f for f in record.metrics.gate_failures if f.startswith("regression score")]
    assert "(mean of 3 seeds, +/- " in failure and "(the shipped set)" in failure and failure in result.stderr
    assert "regression (shipped)" in result.stdout


def test_a_trainer_waits_passively_for_its_threads_without_the_sandbox_too(tmp_path: Path) -> None:
    """With finetune.sandbox = "none" the trainer still gets its environment: OpenMP threads that
    wait passively (on a CPU host they share cores with the engines) and no reaching a model hub."""
    from finetune.runner import train_in_child

    log = tmp_path / "train.log"
    train_in_child(tmp_path, [sys.executable, "-c", "import os; print(os.environ['OMP_WAIT_POLICY'], "
                              "os.environ['HF_HUB_OFFLINE'])"], lambda progress: None, lambda pid: None,
                   lambda: None, limit_s=60, log=log)
    assert log.read_text().split() == ["PASSIVE", "1"]


def test_a_trainer_running_past_its_limit_is_ended_and_fails(tmp_path: Path) -> None:
    """A trainer that keeps beating (so the watchdog sees progress) still cannot hold the worker
    past finetune.max_job_hours: its whole group is ended and the job fails, saying why."""
    from finetune.runner import train_in_child
    from finetune.train import TrainingError

    pids: list[int] = []
    outlived = tmp_path / "outlived"  # written only by a trainer left to end on its own
    trainer = f"import pathlib, time; time.sleep(120); pathlib.Path({str(outlived)!r}).touch()"
    with pytest.raises(TrainingError, match=r"ran past finetune.max_job_hours \(0.0005 h\)"):
        train_in_child(tmp_path, [sys.executable, "-c", trainer], lambda progress: None, pids.append, lambda: None,
                       limit_s=1.8)
    assert not outlived.exists(), "the trainer ran to its own end"
    [pid] = pids
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # ended and reaped


def uneven_rows(count: int) -> list[dict[str, object]]:
    """Chat rows whose prompts and answers differ in length, so that a batch of them is padded."""
    return [{"messages": [{"role": "user", "content": f"What is the code for item {i}?" + " Be brief." * (i % 3)},
                          {"role": "assistant", "content": f"The code for item {i} is" + " ZEBRA" * (1 + i % 4)}]}
            for i in range(count)]


def test_the_cpu_training_loss_is_trls_on_the_labelled_positions_only(tmp_path: Path, demo_model: Path) -> None:
    """On a CPU the trainer projects only the positions from the first label on onto the
    vocabulary; its loss and LoRA gradients are those of TRL's own loss, padding and prompts of
    different lengths included."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.trainer.sft_config import SFTConfig
    from trl.trainer.sft_trainer import SFTTrainer

    from finetune.train import _cpu_sft_trainer, _tokenized

    model_dir = tiny_llama(tmp_path / "tiny", demo_model)
    trainer = _cpu_sft_trainer(SFTTrainer)(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        args=SFTConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=6, report_to=[], use_cpu=True,
                       gradient_checkpointing=False, disable_tqdm=True),
        train_dataset=_tokenized(Dataset, AutoTokenizer.from_pretrained(model_dir), model_dir, uneven_rows(6), 512),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear",
                               task_type="CAUSAL_LM"))
    batch = next(iter(trainer.get_train_dataloader()))
    assert (batch["attention_mask"] == 0).any(), "the batch is padded"
    model = trainer.model
    model.train()
    lora = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        for parameter in lora:
            parameter.normal_(0, 0.05)  # B starts at zero: give the gradients of A something to carry
    found = []
    for compute in (SFTTrainer.compute_loss, type(trainer).compute_loss):
        model.zero_grad()
        loss = compute(trainer, model, dict(batch))
        loss.backward()
        found.append((loss.item(), torch.cat([p.grad.flatten() for p in lora])))
    (trl_loss, trl_grads), (loss, grads) = found
    assert loss == pytest.approx(trl_loss, rel=1e-5)
    torch.testing.assert_close(grads, trl_grads, rtol=1e-4, atol=1e-6)


def test_train_tokens_are_the_real_tokens_and_seconds_the_training(tmp_path: Path, demo_model: Path) -> None:
    """train_tokens counts the tokens fed to the model without the padding (prompts included);
    seconds is the training's alone."""
    from transformers import AutoTokenizer

    from finetune.train import train_adapter

    model_dir = tiny_llama(tmp_path / "tiny", demo_model)
    rows = uneven_rows(12)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lengths = [len(tokenizer.apply_chat_template(row["messages"], return_dict=True)["input_ids"]) for row in rows[:8]]
    assert len(set(lengths)) > 1
    result = train_adapter(model_dir, rows[:8], rows[8:], tmp_path / "out",
                           Hyperparameters(batch_size=4, learning_rate=0.01, save_steps=100))
    assert result is not None and result.steps == 2
    assert result.train_tokens == sum(lengths)
    assert 0 < result.seconds and math.isfinite(result.adapter_eval_loss)
    assert result.adapter_eval_loss < result.base_eval_loss


def test_the_cpu_lora_dropout_drops_each_element_independently_with_its_probability() -> None:
    """The dropout that draws the gaps between dropped elements drops each element (the first and
    the last too) with probability p, independently, and scales the others by 1 / (1 - p), as
    torch's does; it drops nothing in evaluation."""
    import torch
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    from finetune.train import _draw_only_dropped

    model = get_peft_model(torch.nn.Sequential(torch.nn.Linear(4, 4)),
                           LoraConfig(r=2, lora_dropout=0.2, target_modules=["0"]))
    _draw_only_dropped(model)
    [dropout] = [d for m in model.modules() if isinstance(m, LoraLayer) for d in m.lora_dropout.values()]
    assert not isinstance(dropout, torch.nn.Dropout)
    torch.manual_seed(0)
    dropout.train()
    edges = torch.stack([dropout(torch.ones(3)) == 0 for _ in range(20_000)]).float().mean(0)
    assert torch.allclose(edges, torch.full((3,), 0.2), atol=0.015), edges
    x = torch.ones(400, 500)
    y = dropout(x)
    dropped = (y == 0).flatten()
    assert set(y[y != 0].tolist()) == {1 / 0.8}
    for part in (dropped[:100_000], dropped[100_000:]):
        assert abs(part.float().mean().item() - 0.2) < 0.006
    assert abs((dropped[:-1] & dropped[1:]).float().mean().item() - 0.04) < 0.003  # neighbours independent
    dropout.eval()
    assert dropout(x) is x
    # A dropout the trainer turned off (DPO's trainer sets p = 0 on every Dropout) is left as it is.
    model = get_peft_model(torch.nn.Sequential(torch.nn.Linear(4, 4)),
                           LoraConfig(r=2, lora_dropout=0.2, target_modules=["0"]))
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    _draw_only_dropped(model)
    [off] = [d for m in model.modules() if isinstance(m, LoraLayer) for d in m.lora_dropout.values()]
    assert isinstance(off, torch.nn.Dropout) and off.train()(torch.ones(8)).eq(1).all()


def test_a_run_killed_while_writing_a_checkpoint_resumes_from_the_one_before(tmp_path: Path) -> None:
    from finetune.train import _last_checkpoint

    for step in (5, 10):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "adapter_model.safetensors").write_bytes(b"")
    (tmp_path / "checkpoint-5" / "trainer_state.json").write_text("{}")  # written last
    assert _last_checkpoint(tmp_path) == tmp_path / "checkpoint-5"
    (tmp_path / "checkpoint-10" / "trainer_state.json").write_text("{}")
    assert _last_checkpoint(tmp_path) == tmp_path / "checkpoint-10"
    assert _last_checkpoint(tmp_path / "none") is None


def test_dpo_trains_on_a_cpu_with_the_dropout_its_trainer_turned_off(workspace: tuple[dict[str, str], Path],
                                                                     tmp_path: Path) -> None:
    """DPO's trainer turns every dropout off; the CPU's faster dropout must leave those alone."""
    from finetune.train import train_adapter

    _, model = workspace
    rows = [{"prompt": [{"role": "user", "content": f"Say {i}."}], "chosen": [{"role": "assistant", "content": str(i)}],
             "rejected": [{"role": "assistant", "content": "no"}]} for i in range(6)]
    hyperparameters = Hyperparameters(method="dpo", max_steps=2, batch_size=2)
    result = train_adapter(model, rows[:4], rows[4:], tmp_path, hyperparameters)
    assert result is not None and result.steps == 2 and round(result.base_eval_loss, 3) == 0.693
