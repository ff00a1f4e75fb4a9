"""A training job is sized on this host before anything loads: refused naming the figure that does
not fit, and gradient checkpointing on only where the job does not fit without it. The host's
profile is planted; the estimate is the installer's training planner, reached through the
`appliance.job_fit` entry point as the runner reaches it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance.home import Home
from appliance.jobs import Hyperparameters
from appliance.records import Gpu, Host
from appliance.settings import FinetuneSettings
from finetune.runner import size_job
from finetune.train import TrainingError
from installer import train_plan
from installer.train_plan import check_job
from tests.support.models import MODEL_CONFIGS, copy_tokenizer

GIB = 1 << 30
DEMO = MODEL_CONFIGS / "smollm2-135m.json"
HP = Hyperparameters(rank=8, max_length=512, batch_size=4)
UNSANDBOXED = FinetuneSettings(sandbox="none")


def plant_host(monkeypatch: pytest.MonkeyPatch, *, ram: int = 0, gpu_memory: int = 0) -> None:
    gpus = [Gpu(index=0, name="NVIDIA H100 80GB HBM3", memory_bytes=gpu_memory)] if gpu_memory else []
    monkeypatch.setattr(train_plan, "local_host", lambda: Host(name="here", gpus=gpus, ram_bytes=ram or None))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0" if gpus else "")


def one_process(ranks: int = 1, *, checkpointing: bool) -> int:
    """The planner's bytes for one process of HP on the demo model on a CPU, as the runner asks."""
    found = check_job(DEMO, method="lora", rank=8, seq_len=512, batch=4, ranks=ranks, rank_memory_bytes=1 << 50,
                      device="cpu", dtype="fp32")
    if checkpointing:
        found = check_job(DEMO, method="lora", rank=8, seq_len=512, batch=4, ranks=ranks,
                          rank_memory_bytes=found.memory.total - 1, device="cpu", dtype="fp32")
    return found.memory.total


def test_a_job_with_room_trains_without_checkpointing(monkeypatch: pytest.MonkeyPatch) -> None:
    plant_host(monkeypatch, ram=64 * GIB)
    processes, strategy, fit = size_job(DEMO, HP, UNSANDBOXED, seq_len=512)
    assert (processes, strategy, fit.fits, fit.checkpointing) == (1, "single", True, False)
    assert fit.budget_bytes == 64 * GIB and fit.process_bytes == one_process(checkpointing=False)


def test_checkpointing_is_chosen_only_where_the_job_does_not_fit_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    full, checkpointed = one_process(checkpointing=False), one_process(checkpointing=True)
    assert checkpointed < full
    plant_host(monkeypatch, ram=(full + checkpointed) // 2)
    _, _, fit = size_job(DEMO, HP, UNSANDBOXED, seq_len=512)
    assert fit.fits and fit.checkpointing and fit.process_bytes == checkpointed


def test_a_job_that_cannot_fit_is_refused_naming_the_figure_and_the_way_out(monkeypatch: pytest.MonkeyPatch) -> None:
    plant_host(monkeypatch, ram=one_process(checkpointing=True) - 1)
    with pytest.raises(TrainingError, match=r"does not fit this host's 1 process \(single\): .* GiB") as refused:
        size_job(DEMO, HP, UNSANDBOXED, seq_len=512)
    assert "--processes" in (refused.value.hint or "") and "appliance plan --train" in (refused.value.hint or "")


def test_the_sandbox_s_limit_on_each_process_is_the_budget_where_it_is_smaller(
        monkeypatch: pytest.MonkeyPatch) -> None:
    plant_host(monkeypatch, ram=512 * GIB)
    with pytest.raises(TrainingError, match="the 0.5 GiB per-rank budget"):
        size_job(DEMO, HP, FinetuneSettings(sandbox="bubblewrap", sandbox_memory_gib=0.5), seq_len=512)
    _, _, fit = size_job(DEMO, HP, FinetuneSettings(sandbox="bubblewrap", sandbox_memory_gib=64), seq_len=512)
    assert fit.budget_bytes == 64 * GIB


def test_sharding_splits_the_base_where_ddp_holds_it_whole_in_every_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes each get half the host's RAM: sharded, each holds half the base and fits where
    a DDP process, holding it whole, does not."""
    whole, half = one_process(checkpointing=True), one_process(2, checkpointing=True)
    assert half < whole
    plant_host(monkeypatch, ram=half + whole)
    two = HP.model_copy(update={"processes": 2})
    _, strategy, fit = size_job(DEMO, two, FinetuneSettings(sandbox="none", strategy="fsdp"), seq_len=512)
    assert strategy == "fsdp" and fit.fits
    with pytest.raises(TrainingError, match=r"2 processes \(ddp\)"):
        size_job(DEMO, two, FinetuneSettings(sandbox="none", strategy="ddp"), seq_len=512)


def test_a_gpu_process_s_budget_is_its_gpu_less_the_allocator_s_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    plant_host(monkeypatch, ram=4 * GIB, gpu_memory=80 * GIB)
    _, _, fit = size_job(DEMO, HP, UNSANDBOXED, seq_len=512)
    assert fit.fits and fit.budget_bytes == int(80 * GIB * train_plan.GPU_UTILIZATION)


def test_a_host_whose_ram_cannot_be_read_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    plant_host(monkeypatch)
    with pytest.raises(train_plan.TrainPlanError, match="RAM could not be read"):
        size_job(DEMO, HP, UNSANDBOXED, seq_len=512)


def test_a_missing_base_is_said_before_anything(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    plant_host(monkeypatch, ram=64 * GIB)
    with pytest.raises(Exception, match="no such file"):
        size_job(tmp_path / "nothing", HP, UNSANDBOXED, seq_len=512)


@pytest.mark.parametrize("command", ["submit", "run"])
def test_finetune_refuses_a_job_that_cannot_fit_before_it_queues_or_loads_anything(
        monkeypatch: pytest.MonkeyPatch, home: Home, tmp_path: Path, command: str, demo_model: Path) -> None:
    from typer.testing import CliRunner

    from appliance import cli, jobs

    plant_host(monkeypatch, ram=GIB)
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_bytes(DEMO.read_bytes())
    copy_tokenizer(demo_model, base)
    rows = tmp_path / "long.jsonl"  # rows of about 1,500 tokens: the activations are the largest figure
    rows.write_text("".join(json.dumps({"text": f"row {i}: " + "word " * 1500}) + "\n" for i in range(20)))
    env = {"APPLIANCE_HOME": str(home.root)}
    added = CliRunner().invoke(cli.app, ["data", "add", str(rows), "--name", "faq", "--model", str(base)], env=env)
    assert added.exit_code == 0, added.output
    result = CliRunner().invoke(cli.app, ["finetune", command, "--data", "faq", "--name", "bot", "--base", str(base),
                                          "--max-length", "2048"], env=env)
    assert isinstance(result.exception, TrainingError)
    assert "does not fit this host's 1 process (single): activations" in str(result.exception)
    assert jobs.listing(home) == [] and not list(home.root.glob("finetune/bot*"))  # no job, no job directory


def test_a_job_is_sized_for_its_longest_row_not_its_max_length(monkeypatch: pytest.MonkeyPatch, home: Home,
                                                                tmp_path: Path, demo_model: Path) -> None:
    """Batches are padded to their longest row: a job of short rows with a large --max-length is
    sized (and queued) for its rows, and one whose rows are longer than --max-length for that."""
    from typer.testing import CliRunner

    from appliance import cli, jobs
    from finetune.runner import job_seq_len

    short = [{"messages": [{"role": "user", "content": f"Code {i}?"}, {"role": "assistant", "content": "ZEBRA."}]}
             for i in range(20)]
    splits = {"train": "".join(json.dumps(r) + "\n" for r in short).encode(), "eval": b""}
    tokens = job_seq_len(demo_model, HP.model_copy(update={"max_length": 4096}), splits)
    assert 10 < tokens < 100
    assert job_seq_len(demo_model, HP.model_copy(update={"max_length": 8}), splits) == 8
    long_rows = one_process(checkpointing=True)  # the demo at 512 tokens a row, checkpointed
    plant_host(monkeypatch, ram=long_rows - 1)  # 4,096 tokens a row would never fit
    rows = tmp_path / "short.jsonl"
    rows.write_text(splits["train"].decode())
    env = {"APPLIANCE_HOME": str(home.root)}
    added = CliRunner().invoke(cli.app, ["data", "add", str(rows), "--name", "codes", "--model", str(demo_model)],
                               env=env)
    assert added.exit_code == 0, added.output
    queued = CliRunner().invoke(cli.app, ["finetune", "submit", "--data", "codes", "--name", "bot", "--base",
                                          str(demo_model), "--max-length", "4096"], env=env)
    assert queued.exit_code == 0, queued.output
    assert [job.name for job in jobs.listing(home)] == ["bot"]


def test_dpo_is_sized_for_its_chosen_and_rejected_answers_together(monkeypatch: pytest.MonkeyPatch) -> None:
    plant_host(monkeypatch, ram=64 * GIB)
    _, _, sft = size_job(DEMO, HP, UNSANDBOXED, seq_len=512)
    _, _, dpo = size_job(DEMO, HP.model_copy(update={"method": "dpo"}), UNSANDBOXED, seq_len=512)
    doubled = check_job(DEMO, method="lora", rank=8, seq_len=512, batch=8, ranks=1, rank_memory_bytes=1 << 50,
                        device="cpu", dtype="fp32")
    assert dpo.process_bytes == doubled.memory.total > sft.process_bytes
