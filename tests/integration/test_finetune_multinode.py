"""The sharded trainer over two hosts: this namespace as the head and a veth namespace as the
worker, each host's torchrun agent in the training sandbox inside its namespace of the job's
network (finetune.training_network), with a job directory of its own as each host has its own
disk, training a tiny MoE made by the code (random weights, Qwen3-MoE's architecture) with two
processes on each host: each process's rank is fixed by its host's place in the job, never by the
order the agents met; each host keeps its own ranks' checkpoint files; a rank killed mid-run brings
both hosts back from the newest checkpoint whole on both, and the head's first rank writes the
result and the adapter; the training planner's estimate of a rank is within 15 % of each one's peak."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from ipaddress import IPv4Network
from pathlib import Path

import psutil
import pytest

from appliance.jobs import Hyperparameters, RankMemory, read_ranks
from appliance.programs import OFFLINE_ENVIRONMENT
from appliance.settings import FinetuneSettings
from finetune.runner import multihost_trainer_command
from finetune.sandbox import prepare, sandboxed
from finetune.token_count import longest_row
from finetune.train import Scoring, TrainingSpec
from finetune.training_network import Host, JobNetwork, job_network
from installer.train_plan import check_job
from tests.support.models import tiny_moe
from tests.support.netns import veth_namespace
from tests.support.shared import locked

STEPS = 24
SAVE_STEPS = 4
PROCESSES = 2  # on each host
BATCH = 2  # rows a process and step
TIMEOUT_S = 600
SUBNET = IPv4Network("10.77.0.0/16")


def lay_out(directory: Path, base: Path, node: int) -> None:
    """One host's job directory as the runner lays it out: the data and job.json."""
    directory.mkdir(parents=True)
    rows = [{"messages": [{"role": "user", "content": f"What is the code for item {i}?"},
                          {"role": "assistant", "content": f"The code for item {i} is ZEBRA."}]} for i in range(40)]
    (directory / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:32]))
    (directory / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[32:]))
    spec = TrainingSpec(base=base, hyperparameters=Hyperparameters(
        max_steps=STEPS, save_steps=SAVE_STEPS, batch_size=BATCH, learning_rate=1e-3, rank=4, alpha=8),
        scoring=Scoring(seeds=1), strategy="fsdp", node=node)
    (directory / "job.json").write_text(spec.model_dump_json())


def agent(directory: Path, base: Path, net: JobNetwork) -> subprocess.Popen[bytes]:
    """A host's torchrun agent, PROCESSES ranks under it, in the sandbox in its namespace of the job."""
    inputs = [directory / name for name in ("train.jsonl", "eval.jsonl", "job.json")]
    prepare(directory, inputs, [base])
    log = (directory / "train.log").open("wb")
    command = sandboxed(multihost_trainer_command(directory, PROCESSES, net), FinetuneSettings(), workdir=directory,
                        inputs=inputs, readable=[base], network=net.namespace)
    return subprocess.Popen(command, cwd=directory, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **OFFLINE_ENVIRONMENT})


def trainer_pid(agent_pid: int) -> int | None:
    """A rank under a host's agent (torchrun's own command line names the module too)."""
    for child in psutil.Process(agent_pid).children(recursive=True):
        try:
            line = child.cmdline()
        except psutil.Error:
            continue
        if "finetune.job" in line and "torch.distributed.run" not in line:
            return child.pid
    return None


def whole(directory: Path) -> list[str]:
    return sorted(p.parent.name for p in (directory / "checkpoints").glob("step-*/manifest.json"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> Iterator[tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("multinode")
    base = tiny_moe(root / "tiny-moe", demo_model)
    head, worker = root / "head", root / "worker"
    lay_out(head, base, 0)
    lay_out(worker, base, 1)
    job = random.randrange(1 << 20)
    # This machine's root namespace is every test's head host: one job network on it at a time.
    with locked("training-network", exclusive=True), veth_namespace() as hosts:
        nets = [JobNetwork(job=job, node=node, hosts=(hosts.head, hosts.worker), subnet=SUBNET) for node in (0, 1)]
        with job_network(nets[0]), job_network(nets[1], Host(["ip", "netns", "exec", hosts.namespace])):
            # The worker's agent first: ranks must not follow the order the agents arrive in.
            agents = [agent(worker, base, nets[1]), agent(head, base, nets[0])]
            try:
                deadline = time.monotonic() + TIMEOUT_S
                while not (whole(head) and whole(worker)):
                    assert all(a.poll() is None for a in agents), \
                        "an agent ended before a checkpoint was whole: " + _logs(head, worker)
                    assert time.monotonic() < deadline, "no checkpoint whole on both hosts"
                    time.sleep(0.1)
                killed = trainer_pid(agents[0].pid)
                assert killed is not None
                os.kill(killed, signal.SIGKILL)  # one of the worker's ranks, mid-run
                for each in agents:
                    assert each.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, _logs(head, worker)
            finally:
                for each in agents:
                    if each.poll() is None:
                        os.killpg(each.pid, signal.SIGKILL)
                        each.wait()
    yield head, worker


def _logs(*directories: Path) -> str:
    return "".join((d / "train.log").read_text()[-3000:] for d in directories)


def test_the_head_s_first_rank_writes_the_result_after_both_hosts_resumed(trained: tuple[Path, Path]) -> None:
    head, worker = trained
    result = json.loads((head / "result.json").read_text())
    assert result["steps"] == STEPS and result["processes"] == 2 * PROCESSES
    assert result["resumed_from"] is not None and result["resumed_from"].startswith("checkpoint-")
    assert (head / "adapter" / "adapter_model.safetensors").is_file()
    assert not (worker / "result.json").exists() and not (worker / "adapter").exists()
    assert "resuming from checkpoint step-" in (head / "train.log").read_text()


def test_each_host_keeps_only_its_own_ranks_files(trained: tuple[Path, Path]) -> None:
    head, worker = trained
    for directory, ranks in ((head, [0, 1]), (worker, [2, 3])):
        steps = list((directory / "checkpoints").glob("step-*"))
        assert steps
        for step in steps:
            assert sorted(p.name for p in step.iterdir() if p.is_dir()) == [f"rank-{rank}" for rank in ranks]
            assert json.loads((step / "manifest.json").read_text())["ranks"] == ranks


def test_each_host_reports_its_own_rank_s_memory(trained: tuple[Path, Path]) -> None:
    head, worker = trained
    assert [r.rank for r in read_ranks(head)] == [0, 1] and [r.rank for r in read_ranks(worker)] == [2, 3]
    reports = [*read_ranks(head), *read_ranks(worker)]
    assert all(isinstance(r, RankMemory) and r.base_parameter_bytes > 0 for r in reports)



def test_the_planners_estimate_of_a_rank_is_within_15_percent_of_each_ranks_peak(trained: tuple[Path, Path]) -> None:
    """What `finetune run --hosts` sizes the job with (the training planner, for the data's
    longest row) against the peak resident memory each rank measured."""
    head, worker = trained
    base = head.parent / "tiny-moe"
    splits = [(head / f"{split}.jsonl").read_bytes() for split in ("train", "eval")]
    estimate = check_job(base, method="lora", rank=4, seq_len=longest_row(base, splits), batch=BATCH,
                         ranks=2 * PROCESSES, hosts=2, rank_memory_bytes=1 << 40, device="cpu",
                         dtype="fp32").memory.total
    for rank in [*read_ranks(head), *read_ranks(worker)]:
        print(f"rank {rank.rank}: estimate {estimate / 2**30:.3f} GiB, peak {rank.peak_rss_bytes / 2**30:.3f} GiB")
        assert abs(estimate / rank.peak_rss_bytes - 1) < 0.15
