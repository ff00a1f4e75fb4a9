"""Training jobs through the supervised finetune-worker on the session appliance: a
submitted job trains in the training sandbox (no way out, nothing of the state dir but its job), reports progress, and
when the worker is killed mid-training supervisord restarts it and the job resumes from its last
checkpoint; a job whose trainer stops making progress has its worker ended by the watchdog, audited, and resumes
the same way; queued and running jobs can be cancelled; bad submissions change nothing."""

from __future__ import annotations

import json
import os
import pwd
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from appliance import adapters, jobs
from audit.writer import log_files
from tests.integration.conftest import SESSION_SETTINGS, Running
from tests.support.appliances import Appliance
from tests.support.models import tiny_llama
from tests.support.state_modes import modes_not_private


@pytest.fixture(scope="module")
def tiny(running: Running, demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model (fast to train) and a dataset `codes` measured with it."""
    root = tmp_path_factory.mktemp("worker")
    model = tiny_llama(root / "tiny", demo_model)
    rows = [{"messages": [{"role": "user", "content": f"What is the code for item {i}?"},
                          {"role": "assistant", "content": f"The code for item {i} is ZEBRA."}]} for i in range(60)]
    (root / "codes.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    added = running.appliance.run("data", "add", str(root / "codes.jsonl"), "--name", "codes", "--model", str(model),
                                  timeout=300)
    assert added.returncode == 0, added.stderr
    return model


def submit(cli: Appliance, model: Path, name: str, steps: int) -> int:
    queued = cli.run("finetune", "submit", "--data", "codes", "--name", name, "--base", str(model), "--lr", "0.01",
                     "--batch-size", "2", "--max-steps", str(steps), "--save-steps", "5", timeout=60)
    assert queued.returncode == 0, queued.stderr
    return int(re.search(r"job (\d+) queued", queued.stdout).group(1))  # type: ignore[union-attr]


def wait_for(what: str, check: Callable[[], object], timeout_s: float = 300,
             explain: Callable[[], str] = lambda: "") -> object:
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what} {explain()}"
        time.sleep(0.2)
    return found


def checkpointed(cli: Appliance, job_id: int) -> bool:
    return any((jobs.job_dir(cli.home, job_id) / "checkpoints").glob("checkpoint-*/trainer_state.json"))


def test_job_trains_cut_off_from_the_network_and_survives_a_killed_worker(running: Running, tiny: Path) -> None:
    cli = running.appliance
    job_id = submit(cli, tiny, "codes-job", steps=40)
    # The session appliance's one worker may still be busy with another module's job: wait for this one to start
    # (bounded generously: a loaded 2-core machine), then for its first checkpoint.
    wait_for("the job to leave the queue", lambda: jobs.get(cli.home, job_id).state != "queued", 900)
    wait_for("a checkpoint", lambda: checkpointed(cli, job_id), 600,
             lambda: f"job {job_id}: {jobs.get(cli.home, job_id)}")
    job = jobs.get(cli.home, job_id)
    assert job.state == "running" and job.trainer_pid and job.worker_pid
    # Held still while it is looked at: the tiny model trains its 40 steps in seconds, and on a
    # loaded machine the job could be done before `status` shows it running.
    sandbox = [psutil.Process(job.trainer_pid), *psutil.Process(job.trainer_pid).children(recursive=True)]
    for process in sandbox:
        process.send_signal(signal.SIGSTOP)

    # The trainer (inside the sandbox bubblewrap started) is in a network namespace of its own,
    # holding nothing but a loopback device, and sees none of the state dir but its job.
    [trainer] = [p for p in psutil.Process(job.trainer_pid).children(recursive=True)
                 if p.cmdline()[1:4] == ["-P", "-m", "finetune.job"]]  # not bubblewrap's own processes
    assert os.readlink(f"/proc/{trainer.pid}/ns/net") != os.readlink("/proc/self/ns/net")
    devices = [line.split(":")[0].strip() for line in Path(f"/proc/{trainer.pid}/net/dev").read_text().splitlines()[2:]]
    assert devices == ["lo"]
    seen = Path(f"/proc/{trainer.pid}/root")
    assert not (seen / cli.home.secrets.relative_to("/")).exists(), "the secrets are not there"
    assert not (seen / cli.home.run.relative_to("/") / "supervisor.sock").exists()
    assert (seen / jobs.job_dir(cli.home, job_id).relative_to("/") / "job.json").exists()
    if os.geteuid() == 0:
        assert trainer.uids().real == pwd.getpwnam("appliance-train").pw_uid
    listed = cli.run("finetune", "status", str(job_id), timeout=60)
    assert re.search(r"step \d+/40, loss [\d.]+, \d+ tokens/s, ETA \d+ s", listed.stdout), listed.stdout
    for process in sandbox:
        process.send_signal(signal.SIGCONT)

    os.kill(job.worker_pid, signal.SIGKILL)
    wait_for("the trainer to die with its worker", lambda: not Path(f"/proc/{job.trainer_pid}").exists(), 30)
    followed = cli.run("finetune", "status", str(job_id), "--follow", timeout=600)
    assert followed.returncode == 0, followed.stdout + followed.stderr
    job = jobs.get(cli.home, job_id)
    assert job.state == "succeeded" and job.attempts == 2
    assert "40 steps, resumed from checkpoint-" in (job.message or "") and "gate passed" in (job.message or "")
    [record] = adapters.load(cli.home).versions("codes-job")
    assert record.state == "registered" and record.metrics.adapter_eval_loss < record.metrics.base_eval_loss
    # What the job left (its data shown to the sandbox's group alone, checkpoints, logs) is no one else's.
    assert modes_not_private(cli.home) == {}


def test_a_job_making_no_progress_has_its_worker_ended_by_the_watchdog_and_resumes(running: Running,
                                                                                  tiny: Path) -> None:
    cli = running.appliance
    stall_s = float(SESSION_SETTINGS["APPLIANCE_WATCHDOG__TRAINING_STALL_S"])
    job_id = submit(cli, tiny, "codes-stuck", steps=30)
    wait_for("the job to leave the queue", lambda: jobs.get(cli.home, job_id).state != "queued", 900)
    wait_for("a checkpoint", lambda: checkpointed(cli, job_id), 600,
             lambda: f"job {job_id}: {jobs.get(cli.home, job_id)}")
    job = jobs.get(cli.home, job_id)
    assert job.state == "running" and job.trainer_pid and job.worker_pid
    stuck_worker = job.worker_pid
    sandbox = psutil.Process(job.trainer_pid)
    for process in [sandbox, *sandbox.children(recursive=True)]:  # wedged: alive, and not a step more
        process.send_signal(signal.SIGSTOP)

    followed = cli.run("finetune", "status", str(job_id), "--follow", timeout=900)
    assert followed.returncode == 0, followed.stdout + followed.stderr
    assert not psutil.pid_exists(stuck_worker) and not psutil.pid_exists(sandbox.pid)
    job = jobs.get(cli.home, job_id)
    assert job.state == "succeeded" and job.attempts == 2, job
    assert "30 steps, resumed from checkpoint-" in (job.message or "")
    [ended] = [record for path in log_files(cli.home.audit) for line in path.read_bytes().splitlines()
               if (record := json.loads(line))["action"] == "job.requeued" and record["target"]["name"] == str(job_id)]
    assert ended["username"] == "watchdog" and ended["target"]["kind"] == "job"
    assert f"finetune-worker (pid {stuck_worker}) ended" in ended["detail"], ended
    idle = re.search(r"training job \d+: no progress for (\d+) s \(attempt 1\)", ended["detail"])
    assert idle, ended
    # Ended only once the stall limit had passed, by the watchdog's own count since the job's last
    # progress (the test's clock would also count the time before the stop since that progress).
    assert int(idle.group(1)) >= stall_s, ended


def test_cancel_a_queued_and_a_running_job(running: Running, tiny: Path) -> None:
    cli = running.appliance
    running_id = submit(cli, tiny, "codes-long", steps=100_000)
    queued_id = submit(cli, tiny, "codes-later", steps=10)
    cancelled = cli.run("finetune", "cancel", str(queued_id), timeout=60)
    assert cancelled.returncode == 0 and f"job {queued_id}: cancelled" in cancelled.stdout
    assert jobs.get(cli.home, queued_id).state == "cancelled"

    wait_for("training to start", lambda: (jobs.job_dir(cli.home, running_id) / "progress.json").exists())
    stopping = cli.run("finetune", "cancel", str(running_id), timeout=60)
    assert "stopping (its checkpoints stay)" in stopping.stdout
    followed = cli.run("finetune", "status", str(running_id), "-f", timeout=300)
    assert followed.returncode == 1 and f"job {running_id} cancelled" in followed.stdout
    assert not adapters.load(cli.home).versions("codes-long")
    again = cli.run("finetune", "cancel", str(running_id), timeout=60)
    assert again.returncode == 1 and "has already been cancelled" in again.stderr


def test_bad_submissions_are_refused_and_queue_nothing(running: Running, tiny: Path) -> None:
    cli = running.appliance
    before = jobs.listing(cli.home)
    for args, message in [
        (["--data", "nope", "--name", "x"], "no dataset named 'nope'"),
        (["--data", "codes", "--name", "Bad Name"], "--name 'Bad Name': use lower-case letters"),
        (["--data", "codes", "--name", "x", "--base", "/nonexistent"], "/nonexistent has no config.json"),
        (["--data", "codes", "--name", "x", "--rank", "0"], "Invalid value for '--rank'"),
    ]:
        refused = cli.run("finetune", "submit", *args, timeout=60)
        assert refused.returncode != 0 and message in refused.stderr, refused.stderr
    assert jobs.listing(cli.home) == before
    missing = cli.run("finetune", "status", "999", timeout=60)
    assert missing.returncode == 1 and "no training job 999" in missing.stderr
