"""The sharded trainer (FSDP2) on one host, on a CPU with gloo, through `appliance finetune run`
in the training sandbox, on the demo model: two ranks each hold half of the base (measured by the
ranks themselves) and train the same loss curve as one process on the same global batches and
seed; a rank killed after a checkpoint is whole brings every rank back from the last whole
checkpoint, and the job ends with the adapter an uninterrupted run trains, registered and
loadable in PEFT; a MoE base and a QLoRA one (its 4-bit weights sharded) train the same way."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from appliance.adapters import load
from appliance.home import Home
from appliance.jobs import RankMemory, read_launch, read_ranks
from tests.support.appliances import APPLIANCE
from tests.support.models import tiny_llama, tiny_moe

STEPS = 10
GLOBAL_BATCH = 4
# Max |loss(2 ranks) - loss(1 process)| at any step. The two runs differ only in how
# the sums are split over the ranks and in each rank's dropout masks (drawn per rank): measured
# here at most 0.0029 over 20 steps (losses from 2.0 down to 0.0006); the bound leaves 7x room.
# 10 steps: the curve's first half, enough to halve the loss, at half the suite's time.
LOSS_TOLERANCE = 0.02
ESTIMATE_TOLERANCE = 0.15  # the planner's per-rank estimate against a rank's measured peak


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> tuple[dict[str, str], Path]:
    root = tmp_path_factory.mktemp("sharded")
    home = Home(root / "home").ensure()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")},
           "APPLIANCE_HOME": str(home.root), "COLUMNS": "200",
           # Two scenario prompts answered once each: generation in the sharded loop is exercised (on
           # one rank for the demo model, whose tied embeddings it gathers; on two for the MoE and
           # QLoRA bases, which answer in seconds where the demo's two ranks took over 3 minutes),
           # and the test stays short (the shipped regression set is 32 prompts over 3 seeds).
           "APPLIANCE_FINETUNE__REGRESSION_SET": "none", "APPLIANCE_FINETUNE__GATE_SEEDS": "1",
           "APPLIANCE_FINETUNE__GATE_MIN_SCENARIO_SCORE": "0"}
    rows = [{"messages": [{"role": "user", "content": f"What is the code for item {i}?"},
                          {"role": "assistant", "content": f"The code for item {i} is ZEBRA."}]} for i in range(60)]
    data = root / "codes.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "scenarios.jsonl").write_text("".join(
        json.dumps({"prompt": f"What is the code for item {i}?", "expect": "ZEBRA"}) + "\n" for i in range(2)))
    added = subprocess.run([APPLIANCE, "data", "add", str(data), "--name", "codes", "--model", str(demo_model)],
                           env=env, capture_output=True, text=True, timeout=300)
    assert added.returncode == 0, added.stderr
    return env, root


def command(root: Path, demo: Path, name: str, processes: int, save_steps: int, *, scenarios: bool) -> list[str]:
    """The same global batch (GLOBAL_BATCH rows a step) whatever the number of ranks; `scenarios`:
    the gate answers the scenario prompts (generation under FSDP: once is enough, it is slow)."""
    return [APPLIANCE, "finetune", "run", "--data", "codes", "--base", str(demo), "--name", name, "--lr", "0.001",
            "--max-steps", str(STEPS), "--batch-size", str(GLOBAL_BATCH // processes), "--processes", str(processes),
            "--save-steps", str(save_steps), *(["--scenarios", str(root / "scenarios.jsonl")] if scenarios else [])]


def job_dir(env: dict[str, str], name: str) -> Path:
    [found] = (Path(env["APPLIANCE_HOME"]) / "finetune").glob(f"{name}-*")
    return found


def losses(directory: Path) -> list[float]:
    """The first rank's loss at each step, from the trainer's log (a resumed run's steps again)."""
    found: dict[int, float] = {}
    for line in (directory / "train.log").read_text().splitlines():
        if line.startswith('{"step"'):
            report = json.loads(line)
            found[report["step"]] = report["loss"]
    return [found[step] for step in sorted(found)]


def adapter_tensors(directory: Path) -> dict[str, object]:
    from safetensors.torch import load_file

    return dict(load_file(str(directory / "adapter" / "adapter_model.safetensors")))


@pytest.mark.integration
def test_two_ranks_hold_half_the_base_and_train_the_single_process_curve_and_survive_a_killed_rank(
        workspace: tuple[dict[str, str], Path], demo_model: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    env, root = workspace
    fsdp = {**env, "APPLIANCE_FINETUNE__STRATEGY": "fsdp"}  # one process: the sharded loop, nothing to shard
    single = subprocess.run(command(root, demo_model, "codes-one", 1, 100, scenarios=True), env=fsdp,
                            capture_output=True, text=True, timeout=1200)
    assert single.returncode == 0, single.stderr
    sharded = subprocess.run(command(root, demo_model, "codes-two", 2, 100, scenarios=False), env=env,
                             capture_output=True, text=True, timeout=1200)
    assert sharded.returncode == 0, sharded.stderr

    # Memory, as each rank measured it: the sum of its local shards, and its peak resident set.
    [one] = read_ranks(job_dir(env, "codes-one"))
    two: list[RankMemory] = read_ranks(job_dir(env, "codes-two"))
    assert [r.rank for r in two] == [0, 1] and len({r.pid for r in two}) == 2
    for rank in two:
        assert abs(rank.base_parameter_bytes / one.base_parameter_bytes - 0.5) < 0.01
        assert abs(rank.adapter_parameter_bytes / one.adapter_parameter_bytes - 0.5) < 0.01
        assert abs(rank.optimizer_bytes / one.optimizer_bytes - 0.5) < 0.01
        assert rank.peak_rss_bytes < one.peak_rss_bytes
    print("memory:", one, two)
    # The training planner's estimate of one rank, for this job's rows (their longest), against the
    # peak each rank measured.
    launch = read_launch(job_dir(env, "codes-two"))
    assert launch is not None and launch.seq_len is not None and launch.seq_len < 100
    assert launch.estimated_process_bytes is not None
    for rank in two:
        assert abs(launch.estimated_process_bytes / rank.peak_rss_bytes - 1) < ESTIMATE_TOLERANCE, (launch, rank)

    curve_one, curve_two = losses(job_dir(env, "codes-one")), losses(job_dir(env, "codes-two"))
    assert len(curve_one) == len(curve_two) == STEPS
    worst = max(abs(a - b) for a, b in zip(curve_one, curve_two, strict=True))
    print(f"loss curves: max abs diff {worst:.5f} over {STEPS} steps", curve_one, curve_two)
    assert worst < LOSS_TOLERANCE
    assert curve_two[-1] < curve_two[0] / 2

    home = Home(Path(env["APPLIANCE_HOME"]))
    records = {r.name: r for r in load(home).adapters}
    assert records["codes-two"].state == "registered" and records["codes-two"].metrics.processes == 2
    assert records["codes-two"].metrics.steps == STEPS

    # A rank killed once a checkpoint is whole: torchrun starts both again, they resume from it.
    run = subprocess.Popen(command(root, demo_model, "codes-killed", 2, 5, scenarios=False), env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 900
    while not list((Path(env["APPLIANCE_HOME"]) / "finetune").glob("codes-killed-*/checkpoints/step-*/manifest.json")):
        assert run.poll() is None and time.monotonic() < deadline, "no whole checkpoint before the run ended"
        time.sleep(0.2)
    ranks = [p for p in psutil.Process(run.pid).children(recursive=True)
             if "finetune.job" in p.cmdline() and "torch.distributed.run" not in p.cmdline()]
    assert len(ranks) == 2
    os.kill(ranks[1].pid, signal.SIGKILL)
    out, err = run.communicate(timeout=1800)
    assert run.returncode == 0, err
    killed = job_dir(env, "codes-killed")
    log = (killed / "train.log").read_text()
    assert "resuming from checkpoint step-" in log
    assert "resumed from checkpoint-" in out

    # The resumed job trained exactly what the uninterrupted one did (same seed, data order, random
    # states restored), and its adapter is PEFT's format: it loads onto the base.
    resumed, whole = adapter_tensors(killed), adapter_tensors(job_dir(env, "codes-two"))
    assert resumed.keys() == whole.keys() and resumed
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)  # type: ignore[arg-type]
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(demo_model), str(killed / "adapter"))
    loaded = {k: v for k, v in peft.state_dict().items() if "lora_" in k}
    assert len(loaded) == len(whole)
    [(name, tensor)] = [(k, v) for k, v in whole.items() if "layers.0.self_attn.q_proj.lora_B" in k]
    assert torch.equal(loaded[name.replace(".weight", ".default.weight")], tensor)  # type: ignore[arg-type]
    assert load(home).adapters[-1].state == "registered"


@pytest.mark.integration
def test_a_moe_base_trains_sharded_with_its_experts_split_over_the_ranks(workspace: tuple[dict[str, str], Path],
                                                                       demo_model: Path) -> None:
    """A Qwen3-MoE made here (4 routed experts kept fused by transformers, stored one tensor per
    expert): each rank reads and holds 2 experts a layer; the adapters go on the attention
    projections (the routed experts get none; the router is no linear layer)."""
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    env, root = workspace
    moe = tiny_moe(root / "moe", demo_model)
    trained = subprocess.run([APPLIANCE, "finetune", "run", "--data", "codes", "--base", str(moe),
                              "--name", "codes-moe", "--lr", "0.01", "--max-steps", "6", "--batch-size", "2",
                              "--processes", "2", "--scenarios", str(root / "scenarios.jsonl")],
                             env=env, capture_output=True, text=True, timeout=1200)
    assert trained.returncode == 0, trained.stderr
    with safe_open(str(moe / "model.safetensors"), framework="pt") as handle:
        stored = {key: handle.get_slice(key).get_shape() for key in handle.keys()}
    whole = 4 * sum(math.prod(shape) for shape in stored.values())  # float32 in memory
    ranks = read_ranks(job_dir(env, "codes-moe"))
    assert [r.rank for r in ranks] == [0, 1]
    assert sum(r.base_parameter_bytes for r in ranks) == whole
    assert all(abs(r.base_parameter_bytes / whole - 0.5) < 0.02 for r in ranks)
    adapter = job_dir(env, "codes-moe") / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(moe), str(adapter))
    [record] = [r for r in load(Home(Path(env["APPLIANCE_HOME"]))).adapters if r.name == "codes-moe"]
    assert record.state == "registered" and record.metrics.processes == 2


@pytest.mark.integration
def test_qlora_trains_sharded_keeping_its_4bit_weights_with_the_one_rank_curve(
        workspace: tuple[dict[str, str], Path], demo_model: Path) -> None:
    """A 2-layer Llama made here, QLoRA on 1 and on 2 ranks: every decoder linear is held as NF4
    packed 8 values to a float32 (the ranks measure exactly half of that and of the rest, which
    stays float32), the curves agree, and the adapter loads onto the base in PEFT."""
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    env, root = workspace
    tiny = tiny_llama(root / "tiny", demo_model)
    fsdp = {**env, "APPLIANCE_FINETUNE__STRATEGY": "fsdp"}
    for name, processes in (("codes-q1", 1), ("codes-q2", 2)):
        trained = subprocess.run([APPLIANCE, "finetune", "run", "--data", "codes", "--base", str(tiny), "--name", name,
                                  "--qlora", "--lr", "0.002", "--max-steps", "6", "--batch-size", str(4 // processes),
                                  "--processes", str(processes), "--scenarios", str(root / "scenarios.jsonl")],
                                 env=fsdp, capture_output=True, text=True, timeout=1200)
        assert trained.returncode == 0, trained.stderr

    with safe_open(str(tiny / "model.safetensors"), framework="pt") as handle:
        shapes = {key: handle.get_slice(key).get_shape() for key in handle.keys()}
    linear = re.compile(r"^model\.layers\.\d+\..*_proj\.weight$")  # every decoder linear: 4 bits a value
    held = sum(math.prod(s) // 2 if linear.match(k) else 4 * math.prod(s) for k, s in shapes.items())
    [one] = read_ranks(job_dir(env, "codes-q1"))
    two = read_ranks(job_dir(env, "codes-q2"))
    assert one.base_parameter_bytes == held
    assert [r.rank for r in two] == [0, 1] and sum(r.base_parameter_bytes for r in two) == held
    assert all(abs(r.base_parameter_bytes / held - 0.5) < 0.01 for r in two)

    curve_one, curve_two = losses(job_dir(env, "codes-q1")), losses(job_dir(env, "codes-q2"))
    worst = max(abs(a - b) for a, b in zip(curve_one, curve_two, strict=True))
    print(f"QLoRA loss curves: max abs diff {worst:.5f}", curve_one, curve_two)
    assert len(curve_two) == 6 and worst < LOSS_TOLERANCE and curve_two[-1] < curve_two[0]

    adapter = job_dir(env, "codes-q2") / "adapter"
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny), str(adapter))
    [record] = [r for r in load(Home(Path(env["APPLIANCE_HOME"]))).adapters if r.name == "codes-q2"]
    assert record.state == "registered" and record.metrics.processes == 2
