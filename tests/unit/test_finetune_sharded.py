"""The sharded trainer's pieces: which rows of a tensor each rank reads (from a safetensors file,
alone), the batches each step takes, checkpoints that count only when whole, how a job's
processes train (strategy), what `finetune status` reads back from the ranks, and bad
`--processes` values."""

from __future__ import annotations

import json
import os
from ipaddress import IPv4Network
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from appliance import cli
from appliance.jobs import LAUNCH_FILE, RANKS_DIR, Hyperparameters, RankMemory, read_launch, read_ranks
from finetune import checkpoints
from finetune.runner import _trainer_command, choose_strategy, multihost_trainer_command
from finetune.sharded import batch_order, checkpoint_key, local_slice, planned_steps
from finetune.train import TrainingError
from finetune.training_network import JobNetwork


@settings(deadline=None)  # the first example imports torch
@given(rows=st.integers(0, 300), world=st.integers(1, 17))
def test_the_ranks_slices_are_torch_chunks_covering_every_row_once(rows: int, world: int) -> None:
    import torch

    chunks = torch.arange(rows).chunk(world) if rows else ()
    slices = [local_slice((rows, 3), rank, world) for rank in range(world)]
    covered = [i for start, stop in slices for i in range(start, stop)]
    assert covered == list(range(rows))  # in order, each once
    assert [stop - start for start, stop in slices if stop > start] == [len(c) for c in chunks]


def test_a_rank_reads_only_its_rows_of_a_safetensors_tensor(tmp_path: Path) -> None:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    weight = torch.randn(7, 5, dtype=torch.bfloat16)
    save_file({"model.embed_tokens.weight": weight}, str(tmp_path / "model.safetensors"))
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        parts = []
        for rank in range(3):
            start, stop = local_slice(tuple(weight.shape), rank, 3)
            parts.append(handle.get_slice("model.embed_tokens.weight")[start:stop])
    assert [p.shape[0] for p in parts] == [3, 3, 1]
    assert torch.equal(torch.cat(parts), weight)


@pytest.mark.parametrize(("name", "key"), [
    ("base_model.model.model.layers.3.self_attn.q_proj.base_layer.weight", "model.layers.3.self_attn.q_proj.weight"),
    ("base_model.model.model.norm.weight", "model.norm.weight"),
    ("base_model.model.model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.gate_up_proj"),
])
def test_peft_parameter_names_map_to_the_checkpoints_names(name: str, key: str) -> None:
    assert checkpoint_key(name) == key


def test_each_step_takes_a_global_batch_fixed_by_the_seed_and_the_step() -> None:
    order = batch_order(rows=10, global_batch=4, steps=5, seed=3)
    assert order == batch_order(rows=10, global_batch=4, steps=5, seed=3) != batch_order(10, 4, 5, seed=4)
    assert all(len(batch) == 4 and len(set(batch)) == 4 for batch in order)
    assert len(set(order[0] + order[1])) == 8  # an epoch (8 of 10 rows: whole batches) repeats no row
    assert planned_steps(Hyperparameters(max_steps=-1, epochs=2), rows=10, global_batch=4) == 4
    assert planned_steps(Hyperparameters(max_steps=7), rows=10, global_batch=4) == 7


def whole_checkpoint(store: Path, step: int, world: int = 2, ranks: tuple[int, ...] = (0, 1)) -> Path:
    """A node's part of a checkpoint as the trainer writes it: a directory a rank, its manifest last."""
    directory = store / f"step-{step}"
    directory.mkdir(parents=True)
    names = [f"rank-{r}/{name}" for r in ranks for name in (".metadata", "__0_0.distcp", "rng.pt")]
    for name in names:
        (directory / name).parent.mkdir(exist_ok=True)
        (directory / name).write_bytes(os.urandom(64))
    checkpoints.write_manifest(directory, step, step * 100, world, list(ranks),
                               {name: checkpoints.sha256(directory / name) for name in names})
    return directory


def test_the_whole_checkpoints_are_found_and_partial_or_tampered_ones_are_said_and_ignored(
        tmp_path: Path) -> None:
    whole = whole_checkpoint(tmp_path, 5)
    whole_checkpoint(tmp_path, 10)
    (tmp_path / "step-10" / "rank-1" / "__0_0.distcp").write_bytes(b"changed")  # written over after its manifest
    whole_checkpoint(tmp_path, 15)
    (tmp_path / "step-15" / "rank-1" / "rng.pt").unlink()  # a rank's file gone
    partial = tmp_path / "step-20"
    (partial / "rank-0").mkdir(parents=True)
    (partial / "rank-0" / "__0_0.distcp").write_bytes(b"cut short")  # killed before the manifest
    said: list[str] = []
    assert checkpoints.whole_steps(tmp_path, 2, said.append) == [5]
    assert said == ["checkpoint step-20 ignored: no manifest (cut short while it was written)",
                    "checkpoint step-15 ignored: rank-1/rng.pt is missing",
                    "checkpoint step-10 ignored: rank-1/__0_0.distcp does not match its SHA-256"]
    assert checkpoints.problem(whole, 4) == "written by 2 ranks, this run has 4"
    assert checkpoints.whole_steps(tmp_path / "none", 2, said.append) == []


def test_the_ranks_resume_from_the_newest_step_whole_on_every_node(tmp_path: Path) -> None:
    """Two hosts, each with its own disk: node 1 died after node 0 finished step 15."""
    for step in (5, 10, 15):
        whole_checkpoint(tmp_path / "node0", step, world=4, ranks=(0, 1))
    for step in (5, 10):
        whole_checkpoint(tmp_path / "node1", step, world=4, ranks=(2, 3))
    per_node = [checkpoints.whole_steps(tmp_path / f"node{n}", 4, lambda line: None) for n in (0, 1)]
    assert per_node == [[15, 10, 5], [10, 5]]
    assert checkpoints.newest_common(per_node) == 10
    assert checkpoints.newest_common([[15], [10]]) is None and checkpoints.newest_common([]) is None


@pytest.mark.parametrize("manifest", [
    "not json", "[]",
    json.dumps({"step": 5, "tokens": 1, "world_size": 2, "ranks": [0, 1], "files": {"../x": "0"}}),
    json.dumps({"step": 5, "tokens": 1, "world_size": 2, "ranks": [0, 1],
                "files": {"rank-0/../../../etc/passwd": "0"}}),
    json.dumps({"step": 6, "tokens": 1, "world_size": 2, "ranks": [0, 1], "files": {}}),
    json.dumps({"step": 5, "tokens": 1, "world_size": 2, "ranks": [0, 1], "files": {"rank-0/.metadata": "0"}}),
    json.dumps({"step": 5, "tokens": 1, "world_size": 2, "ranks": [], "files": {}}),
    json.dumps({"step": 5, "tokens": 1, "world_size": 2, "ranks": [True], "files": {}}),
    json.dumps({"step": 5, "tokens": 1, "world_size": 2, "ranks": "0", "files": {}}),
])
def test_a_manifest_that_is_not_one_makes_its_checkpoint_unusable(tmp_path: Path, manifest: str) -> None:
    directory = whole_checkpoint(tmp_path, 5)
    (directory / checkpoints.MANIFEST).write_text(manifest)
    assert checkpoints.problem(directory, 2) is not None
    assert checkpoints.whole_steps(tmp_path, 2, lambda line: None) == []


def test_pruning_keeps_the_two_newest_whole_checkpoints(tmp_path: Path) -> None:
    for step in (5, 10, 15):
        whole_checkpoint(tmp_path, step)
    (tmp_path / "step-3").mkdir()  # partial, older than a whole one
    (tmp_path / "step-20").mkdir()  # partial, being written: kept
    checkpoints.prune(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-10", "step-15", "step-20"]


@pytest.mark.parametrize(("setting", "processes", "method", "qlora", "chosen"), [
    ("auto", 1, "sft", False, "single"),
    ("auto", 2, "sft", False, "fsdp"),
    ("auto", 4, "sft", False, "fsdp"),
    ("auto", 2, "dpo", False, "ddp"),
    ("ddp", 2, "sft", False, "ddp"),
    ("ddp", 1, "sft", False, "single"),
    ("fsdp", 1, "sft", False, "fsdp"),
    ("single", 1, "sft", True, "single"),
    ("auto", 2, "sft", True, "fsdp"),  # QLoRA sharded: each rank's rows of the packed 4-bit weights
    ("fsdp", 1, "sft", True, "fsdp"),
    ("ddp", 2, "sft", True, "ddp"),
])
def test_strategy_choice(setting: str, processes: int, method: str, qlora: bool, chosen: str) -> None:
    hp = Hyperparameters(method=method, qlora=qlora)
    assert choose_strategy(setting, processes, hp) == chosen


@pytest.mark.parametrize(("setting", "processes", "hp", "said"), [
    ("single", 2, Hyperparameters(), "trains in one process, not 2"),
    ("fsdp", 2, Hyperparameters(method="dpo"), "trains SFT only, not dpo"),
])
def test_strategies_that_cannot_run_are_refused_before_anything_loads(setting: str, processes: int,
                                                                       hp: Hyperparameters, said: str) -> None:
    with pytest.raises(TrainingError, match=said):
        choose_strategy(setting, processes, hp)


def test_the_sharded_trainer_runs_under_torchrun_which_restarts_its_ranks(tmp_path: Path) -> None:
    sharded = _trainer_command(tmp_path, 2, "fsdp", cpu=True)
    assert "--nproc-per-node=2" in sharded and any(a.startswith("--max-restarts=") for a in sharded)
    assert sharded[-3:] == ["-m", "finetune.job", str(tmp_path)]
    ddp = _trainer_command(tmp_path, 2, "ddp", cpu=True)
    assert "--nproc-per-node=2" in ddp and not any(a.startswith("--max-restarts=") for a in ddp)
    assert "torch.distributed.run" not in _trainer_command(tmp_path, 1, "single", cpu=True)
    assert "torch.distributed.run" in _trainer_command(tmp_path, 1, "fsdp", cpu=False)
    # Each start of the ranks a store of its own: the shared rendezvous store kept dead ranks' keys.
    assert all("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in _trainer_command(tmp_path, 2, "fsdp", cpu=cpu)
               for cpu in (True, False))


def test_a_host_s_agent_of_a_job_over_hosts_meets_the_others_at_the_head_s_ranks(tmp_path: Path) -> None:
    net = JobNetwork(job=7, node=1, hosts=("192.0.2.10", "192.0.2.11", "192.0.2.12"),
                     subnet=IPv4Network("10.77.0.0/16"))
    command = multihost_trainer_command(tmp_path, 4, net)
    assert {"--nnodes=3", "--nproc-per-node=4", "--rdzv-backend=c10d", "--rdzv-endpoint=10.77.0.2:29400",
            "--rdzv-id=job-7", "--rdzv-conf=is_host=0", "--local-addr=10.77.1.2"} <= set(command)
    assert "GLOO_SOCKET_IFNAME=atj7r" in command and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in command
    assert command[-3:] == ["-m", "finetune.job", str(tmp_path)]
    head = multihost_trainer_command(tmp_path, 4, JobNetwork(job=7, node=0, hosts=net.hosts, subnet=net.subnet))
    assert "--rdzv-conf=is_host=1" in head and "--local-addr=10.77.0.2" in head


def rank_report(rank: int) -> str:
    return RankMemory(rank=rank, host="h", pid=100 + rank, base_parameter_bytes=10, adapter_parameter_bytes=2,
                      optimizer_bytes=4, peak_rss_bytes=1000).model_dump_json()


def test_status_reads_the_launch_and_each_ranks_report_and_nothing_else(tmp_path: Path) -> None:
    assert read_launch(tmp_path) is None and read_ranks(tmp_path) == []
    (tmp_path / LAUNCH_FILE).write_text(json.dumps({"strategy": "fsdp", "processes": 2, "seq_len": 40,
                                                    "estimated_process_bytes": 1 << 30}))
    ranks = tmp_path / RANKS_DIR
    ranks.mkdir()
    (ranks / "rank-1.json").write_text(rank_report(1))
    (ranks / "rank-0.json").write_text(rank_report(0))
    (ranks / "rank-2.json").write_text('{"rank": 2}')  # not a report
    (ranks / "rank-3.json").write_text(rank_report(3) + " " * 5000)  # too large
    (ranks / "rank-4.json").symlink_to(ranks / "rank-0.json")  # a link the trainer made
    launch = read_launch(tmp_path)
    assert launch is not None and launch.strategy == "fsdp" and launch.estimated_process_bytes == 1 << 30
    assert [(r.rank, r.pid) for r in read_ranks(tmp_path)] == [(0, 100), (1, 101)]
    for bad in ({"strategy": "rm -rf", "processes": 1}, {"strategy": "fsdp", "processes": [2]},
                {"strategy": "fsdp", "processes": 2, "estimated_process_bytes": -1}, ["fsdp"]):
        (tmp_path / LAUNCH_FILE).write_text(json.dumps(bad))
        assert read_launch(tmp_path) is None


@pytest.mark.parametrize("command", ["run", "submit"])
@pytest.mark.parametrize(("value", "said"), [("0", "greater than or equal to 1"),
                                             ("two", "valid integer"),
                                             ("-1", "greater than or equal to 1")])
def test_bad_processes_are_refused_by_name(command: str, value: str, said: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(cli.app, ["finetune", command, "--data", "d", "--name", "n", "--processes", value],
                                env={"APPLIANCE_HOME": str(tmp_path / "home"), "COLUMNS": "200"})
    assert result.exit_code == 2
    assert "Invalid value for '--processes'" in result.output and said in result.output
    assert not (tmp_path / "home" / "finetune").exists()


@pytest.mark.parametrize(("setting", "hp", "said"), [
    ("ddp", Hyperparameters(), 'not finetune.strategy = "ddp"'),
    ("single", Hyperparameters(), 'not finetune.strategy = "single"'),
    ("auto", Hyperparameters(method="dpo"), "not DPO"),
])
def test_a_job_over_several_hosts_trains_sharded_or_is_refused_saying_why(setting: str, hp: Hyperparameters,
                                                                          said: str) -> None:
    assert choose_strategy("auto", 1, Hyperparameters(), hosts=2) == "fsdp"  # one process a host too
    assert choose_strategy("auto", 2, Hyperparameters(qlora=True), hosts=2) == "fsdp"
    with pytest.raises(TrainingError, match=said):
        choose_strategy(setting, 1, hp, hosts=3)


@pytest.mark.parametrize("hosts", ["w1,../etc", "w1,,w2", "a b", "-w1", "w1\nw2"])
def test_bad_host_names_are_refused_by_name_before_anything(hosts: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(cli.app, ["finetune", "submit", "--data", "d", "--name", "n", "--hosts", hosts],
                                env={"APPLIANCE_HOME": str(tmp_path / "home"), "COLUMNS": "200"})
    assert result.exit_code != 0
    assert "--hosts" in str(result.exception) + result.output and "host names separated by commas" in \
        str(result.exception) + result.output
    assert not (tmp_path / "home" / "finetune").exists()
