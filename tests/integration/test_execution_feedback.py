"""Post-training from execution feedback end to end, on an appliance of this module's own whose
artifact store is a real S3 server (its tokens from the session's Keycloak): a run over 20 tasks on
the demo model through the gateway under the RL service identity, with self-correction rounds; a
sandbox worker and then the run's own worker killed mid-run, and the run resumes with every
execution's result kept once; trajectories in the bucket, verified (and a tampered segment
refused); SFT and DPO sets built from them; an adapter trained on the SFT set, deployed, and gated
on held-out pass@1 over three seeds."""

from __future__ import annotations

import io
import json
import math
import os
import signal
import sqlite3
import subprocess
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import psutil
import pytest
from textual.pilot import Pilot

from appliance import adapters, login
from appliance import connection as connections
from appliance.admin_client import AdminClient, Refused
from appliance.jobs import FINISHED, JobState
from appliance.rl import exports, runs
from appliance.rl.attempts import Attempt
from appliance.rl.progress import RunProgress, read_progress
from appliance.secrets import GATEWAY_CLIENT_SECRET, RL_CLIENT_SECRET, secret
from appliance.settings import load_settings
from appliance.tls import ca_file
from audit.reader import read_records
from audit.writer import log_files
from finetune.rl.starter import starter_tasks
from finetune.rl.tasks import split
from installer.realm import BOOTSTRAP_SECRET
from tests.integration.conftest import Running, client, s3_server, s3_settings
from tests.integration.realm import Realm
from tests.support.appliances import APPLIANCE, Appliance, make_appliance
from tests.support.pilot import drive, rows, select_row, text, until
from tests.support.state_modes import modes_not_private
from tui.app import AdminApp

# Its RL run starts executions as the sandbox's users.
pytestmark = pytest.mark.usefixtures("sandbox_users_to_itself")

MODEL = "SmolLM2-135M-Instruct"
BUCKET = "appliance-artifacts"


def tasks_file(path: Path) -> Path:
    """The starter set's tasks as a JSONL file, as an operator would bring one."""
    path.write_text("".join(task.model_dump_json() + "\n" for task in starter_tasks()))
    return path


@dataclass
class Lab:
    cli: Appliance
    realm: Realm
    s3: str
    work: Path


@pytest.fixture(scope="module")
def lab(running: Running, demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    work = tmp_path_factory.mktemp("rl")
    session = running.appliance.home
    realm = Realm(running)
    external = {"APPLIANCE_KEYCLOAK__URL": realm.settings.keycloak.base_url,
                "APPLIANCE_KEYCLOAK__CA_FILE": str(ca_file(session)),
                "APPLIANCE_KEYCLOAK__GATEWAY_CLIENT_SECRET": secret(session, GATEWAY_CLIENT_SECRET),
                "APPLIANCE_EXECUTION__WORKER_IDLE_S": "30", "APPLIANCE_POOLS__MAIN__ENABLE_LORA": "true"}
    for s3 in s3_server(work / "s3"):
        for cli in make_appliance(demo_model, None, **external, **s3_settings(s3)):
            # The RL client was provisioned in the session's realm: this appliance holds its secret.
            fd = os.open(cli.home.secrets / RL_CLIENT_SECRET, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, (secret(session, RL_CLIENT_SECRET) + "\n").encode())
            os.close(fd)
            up = cli.run("up")
            assert up.returncode == 0, up.stdout + up.stderr
            yield Lab(cli, realm, s3, work)


def progress(cli: Appliance, run_id: int) -> RunProgress | None:
    return read_progress(cli.home, run_id)


def wait_for(what: str, check: object, timeout_s: float = 900) -> object:
    deadline = time.monotonic() + timeout_s
    while not (found := check()):  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return found


def rl_worker(cli: Appliance) -> psutil.Process:
    status = json.loads(cli.run("status", "--json").stdout)
    [program] = [p for p in status["programs"] if p["name"] == "rl-worker"]
    return psutil.Process(program["pid"])


def held_execution(cli: Appliance, run_id: int, workers: list[psutil.Process]) -> tuple[psutil.Process, str] | None:
    """A sandbox worker that holds an execution now, and the execution's key."""
    path = runs.run_dir(cli.home, run_id) / "run.sqlite"
    if not path.exists():  # the run's worker has not taken it up yet
        return None
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30) as db:
        holders = dict(db.execute("select worker_pid, key from executions where state = 'running'").fetchall())
    return next(((worker, holders[worker.pid]) for worker in workers if worker.pid in holders), None)


def sandbox_workers(worker: psutil.Process) -> list[psutil.Process]:
    return [child for child in worker.children() if "finetune.rl.executor" in " ".join(child.cmdline())]


def test_a_run_survives_killed_workers_and_leaves_verifiable_trajectories_in_the_bucket(lab: Lab) -> None:
    cli = lab.cli
    bad = lab.work / "bad.jsonl"
    bad.write_text('{"id": "x", "prompt": "p"}\n{"id": "y", "prompt": "p", "tests": "t", "language": "c"}\n')
    refused = cli.run("rl", "tasks", "add", str(bad), "--name", "bad")
    assert refused.returncode == 1 and "line 1:" in refused.stderr and "line 2:" in refused.stderr, refused.stderr
    added = cli.run("rl", "tasks", "add", str(tasks_file(lab.work / "easy.jsonl")), "--name", "easy")
    assert added.returncode == 0 and "20 tasks (16 train, 4 held out)" in added.stdout, added.stdout + added.stderr
    assert "bad" not in cli.run("rl", "tasks", "list").stdout

    queued = cli.run("rl", "run", "--tasks", "easy", "--split", "all", "--base", MODEL, "--samples", "2",
                     "--rounds", "1", "--max-tokens", "96", "--temperature", "0.7")
    assert queued.returncode == 0, queued.stderr
    run_id = runs.listing(cli.home)[-1].id

    # A sandbox worker dies holding an execution: the execution is taken up again by another.
    worker = rl_worker(cli)
    held = wait_for("a sandbox worker holding an execution",
                    lambda: held_execution(cli, run_id, sandbox_workers(worker)), timeout_s=600)
    assert isinstance(held, tuple)
    victim, interrupted = held
    victim.send_signal(signal.SIGKILL)

    # Then the run's own worker dies: supervisord starts it again and the run resumes.
    wait_for("a dozen attempts", lambda: (p := progress(cli, run_id)) and p.attempts_done >= 12)
    worker.send_signal(signal.SIGKILL)
    followed = cli.run("rl", "status", str(run_id), "--follow", timeout=1800)
    assert followed.returncode == 0, followed.stdout + followed.stderr
    run = runs.get(cli.home, run_id)
    assert run.state == "succeeded" and run.attempts == 2, run

    listed = cli.run("rl", "show-trajectories", str(run_id), "--json")
    assert listed.returncode == 0, listed.stderr
    attempts = [Attempt.model_validate(a) for a in json.loads(listed.stdout)]
    keys = [a.key for a in attempts]
    assert len(keys) == len(set(keys)), "an attempt was recorded twice"
    chains: dict[tuple[str, int], list[Attempt]] = defaultdict(list)
    for attempt in attempts:
        chains[(attempt.task, attempt.sample)].append(attempt)
    assert len(chains) == 40  # 20 tasks x 2 samples: none lost
    for chain in chains.values():  # each sample's rounds: failures corrected until one passes or rounds run out
        chain.sort(key=lambda a: a.round)
        assert [a.round for a in chain] == list(range(len(chain)))
        assert all(a.status == "failed" and a.feedback for a in chain[:-1])
        assert chain[-1].status != "failed" or chain[-1].round == 1  # passed, could not run, or no rounds left
    corrections = [a for a in attempts if a.round == 1]
    assert corrections and all(a.messages[-1]["content"] == a.messages[-1]["content"].strip() for a in corrections)
    with sqlite3.connect(runs.run_dir(cli.home, run_id) / "run.sqlite") as db:
        executions = db.execute("select key, state, claims, worker_pid from executions").fetchall()
    assert {key for key, *_ in executions} == set(keys) and all(state == "done" for _, state, *_ in executions)
    [(_, _, claims, finished_by)] = [row for row in executions if row[0] == interrupted]
    assert claims >= 2 and finished_by != victim.pid, "the killed sandbox worker's execution was not taken up again"

    figures = progress(cli, run_id)
    assert figures is not None and figures.attempts_done == len(attempts) and figures.tasks == 20
    print(f"run {run_id}: {figures.attempts_done} attempts, pass rate {figures.pass_rate:.0%}, first answers "
          f"{figures.first_pass_rate:.0%}, mean reward {figures.mean_reward:.3f}, corrections {len(corrections)}")

    # In the bucket: content-addressed segments and the manifest; a changed segment is refused.
    bucket = client(lab.s3)
    objects = sorted(o.object_name for o in bucket.list_objects(BUCKET, prefix=f"trajectories/run-{run_id}/",
                                                                recursive=True))
    assert f"trajectories/run-{run_id}/manifest.json" in objects
    segments = [name for name in objects if "/segments/" in name]
    assert segments
    original = bucket.get_object(BUCKET, segments[0]).read()
    changed = original.replace(b'"reward":', b'"reward": ', 1)
    bucket.put_object(BUCKET, segments[0], io.BytesIO(changed), len(changed))
    tampered = cli.run("rl", "show-trajectories", str(run_id))
    assert tampered.returncode == 1 and "was changed" in tampered.stderr, tampered.stdout + tampered.stderr
    bucket.put_object(BUCKET, segments[0], io.BytesIO(original), len(original))
    shown = cli.run("rl", "show-trajectories", str(run_id), "--task", corrections[0].task)
    assert shown.returncode == 0 and "fed back" in shown.stdout, shown.stderr

    # Every generation went through the gateway as the service identity, and was audited.
    records = [json.loads(line) for path in log_files(cli.home.audit) for line in path.read_bytes().splitlines()]
    asked = [r for r in records if r["action"] == "chat.completions"]
    assert len(asked) >= len(attempts)  # an answer cut off by the killed worker was asked for again
    assert all((r["username"], r["client"], r["outcome"]) == ("service-account-appliance-rl", "appliance-rl", "allowed")
               for r in asked), asked[:2]
    changes = {r["action"] for r in records}
    assert {"rl.tasks.add", "rl.submit", "rl.run"} <= changes


def test_sft_and_dpo_sets_train_adapters_that_are_gated_served_and_canaried(lab: Lab) -> None:
    cli = lab.cli
    [run] = [r for r in runs.listing(cli.home) if r.spec.split == "all"]
    exported = cli.run("rl", "export", str(run.id), "--sft", "rl-sft", "--dpo", "rl-dpo")
    assert exported.returncode == 0, exported.stdout + exported.stderr
    assert "SFT set: dataset rl-sft" in exported.stdout and "preference set: dataset rl-dpo" in exported.stdout
    # The run covered every task; the held-out ones' attempts stay out of training data.
    held_out_ids = {task.id for task in split(starter_tasks(), 0.2)["held_out"]}  # rl.held_out_fraction
    held_out = sum(a.task in held_out_ids for a in rl_attempts(cli, run.id))
    assert f"left out: {held_out} attempts at the task set's held-out tasks" in exported.stdout
    assert {key.split("/")[0] for key in
            (o.object_name for o in client(lab.s3).list_objects(BUCKET, recursive=True))} >= {"datasets", "tasksets",
                                                                                              "trajectories"}

    # v1: SFT on the passing attempts, gated on held-out loss and a regression set against forgetting.
    regression = lab.work / "regression.jsonl"
    regression.write_text(json.dumps({"prompt": "What is the capital of France?", "expect": "Paris"}) + "\n")
    # (Its regression set answered with one seed: the RL gate below is the one over three.)
    trained = subprocess.run([APPLIANCE, "finetune", "run", "--data", "rl-sft", "--name", "rl-coder", "--base", MODEL,
                              "--max-steps", "6", "--lr", "0.0005", "--batch-size", "4", "--regression",
                              str(regression)], env={**cli.env, "APPLIANCE_FINETUNE__GATE_SEEDS": "1"},
                             capture_output=True, text=True, timeout=1200)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    wrong = cli.run("finetune", "run", "--data", "rl-dpo", "--name", "x", "--base", MODEL, timeout=300)
    assert wrong.returncode == 1 and "holds preference rows: train on it with --method dpo" in wrong.stderr
    login = cli.run("token", "--user", "admin", "--password-stdin",
                    stdin=secret(lab.realm.running.appliance.home, BOOTSTRAP_SECRET) + "\n", timeout=60)
    assert login.returncode == 0, login.stderr
    deployed = cli.run("adapters", "deploy", "rl-coder", "--role", "user", "--role", "admin", timeout=300)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr

    gated = cli.run("rl", "gate", "rl-coder", "--tasks", "easy", "--base", MODEL, "--seeds", "3", "--samples", "2",
                    "--max-tokens", "96", timeout=1800)
    print(gated.stdout)
    v1 = adapters.load(cli.home).find("rl-coder", 1)
    assert "regression" in v1.metrics.eval_sets
    # The scores it reports, per seed: the base model's line, then the adapter's.
    import re
    reported = [[int(score) / 100 for score in re.findall(r"(\d+)%", seeds)]
                for seeds in re.findall(r"pass@1 [\d.]+% \+/- [\d.]+% over 3 seeds \(([^)]*)\)", gated.stdout)]
    assert len(reported) == 2 and all(len(seeds) == 3 for seeds in reported), gated.stdout
    base_scores, adapter_scores = reported
    # Each adapter seed's score is its run's mean over held-out tasks of the share of first answers
    # (2 samples a task) that passed.
    adapter_runs = sorted((r for r in runs.listing(cli.home) if r.spec.adapter == "rl-coder"), key=lambda r: r.id)
    assert len(adapter_runs) == 3 and all(r.state == "succeeded" and r.spec.samples == 2 for r in adapter_runs)
    for adapter_run, score in zip(adapter_runs, adapter_scores, strict=True):
        attempts = rl_attempts(cli, adapter_run.id)
        assert attempts and all(a.adapter == "rl-coder" and a.adapter_version == 1 for a in attempts)
        first = [a for a in attempts if a.round == 0]
        assert {a.task for a in first} == held_out_ids and {a.sample for a in first} == {0, 1}
        shares = [sum(a.status == "passed" for a in first if a.task == task) / 2 for task in held_out_ids]
        assert abs(sum(shares) / len(shares) - score) <= 0.005 + 1e-9, (adapter_run, score)  # shown to 1%
    # The registry holds those scores' means and the difference's interval, and the decision is
    # the rule applied to it: --max-drop 0, so the interval's lower end at least 0.
    scores = v1.metrics.eval_sets["held_out_pass@1"]
    base_mean, adapter_mean = sum(base_scores) / 3, sum(adapter_scores) / 3
    assert abs(scores.base - base_mean) <= 0.005 + 1e-9 and abs(scores.adapter - adapter_mean) <= 0.005 + 1e-9, \
        (scores, reported)
    assert scores.base_per_seed == pytest.approx(base_scores, abs=0.0051)  # each seed's, and their spread, kept
    assert scores.adapter_per_seed == pytest.approx(adapter_scores, abs=0.0051) and scores.adapter_spread >= 0
    [(low, high)] = re.findall(r"95% interval \[([-+][\d.]+)%, ([-+][\d.]+)%\], paired bootstrap over "
                               rf"{len(held_out_ids)} tasks", gated.stdout)
    assert scores.difference_95 == pytest.approx((float(low) / 100, float(high) / 100), abs=0.0006)
    # The known-good side: taught the passing answers, it passes (its interval's lower end was about
    # +29 % on this set), and the decision is the rule applied to the interval it reports.
    assert float(low) >= 0 and gated.returncode == 0, gated.stdout + gated.stderr
    assert "gate: passed" in gated.stdout and v1.metrics.gate_failures == []

    # v2: DPO on the preference set (its base loss is ln 2: the base prefers neither answer), tried as
    # a canary beside v1; the gate will not measure while two versions answer.
    # Nothing here is about the shipped regression set (v1's job answered it): this job skips it.
    dpo = subprocess.run([APPLIANCE, "finetune", "run", "--data", "rl-dpo", "--name", "rl-coder", "--base", MODEL,
                          "--method", "dpo", "--max-steps", "4", "--lr", "0.0005", "--batch-size", "2"],
                         env={**cli.env, "APPLIANCE_FINETUNE__REGRESSION_SET": "none"}, capture_output=True,
                         text=True, timeout=1200)
    assert dpo.returncode == 0, dpo.stdout + dpo.stderr
    v2 = adapters.load(cli.home).find("rl-coder", 2)
    assert v2.hyperparameters.method == "dpo" and round(v2.metrics.base_eval_loss, 3) == 0.693
    canary = cli.run("adapters", "canary", "rl-coder", "--version", "2", "--share", "0.5", timeout=300)
    assert canary.returncode == 0 and "v2 gets 50% of requests, v1 the rest" in canary.stdout, canary.stderr
    refused = cli.run("rl", "gate", "rl-coder", "--tasks", "easy", "--base", MODEL, timeout=60)
    assert refused.returncode == 1 and "has a canary" in refused.stderr
    rolled = cli.run("adapters", "rollback", "rl-coder", timeout=300)
    assert rolled.returncode == 0 and "rl-coder serves v1" in rolled.stdout, rolled.stderr



# A small repository whose functions its own tests call: `rl tasks make` plants one bug in each.
MATHY = {"mathy/__init__.py": ("def add(a, b):\n    return a + b\n\n\ndef double(x):\n    return 2 * x\n\n\n"
                               "def is_even(n):\n    return n % 2 == 0\n\n\ndef clamp(x, low, high):\n"
                               "    return max(low, min(x, high))\n"),
         "tests/test_mathy.py": ("from mathy import add, clamp, double, is_even\n\n\ndef test_add():\n"
                                 "    assert add(2, 3) == 5\n\n\ndef test_double():\n    assert double(4) == 8\n\n\n"
                                 "def test_is_even():\n    assert is_even(4) and not is_even(3)\n\n\n"
                                 "def test_clamp():\n    assert clamp(5, 0, 3) == 3 and clamp(-1, 0, 3) == 0\n")}
# Calls any repository task takes (structured output, in the hermes parser's form; see repository_tasks.CALLS).
ANY_TASK_CALLS = r'<tool_call>\n\{"name": "(list_files|run_tests|submit)", "arguments": \{\}\}\n</tool_call>'


def test_the_agent_gate_measures_episodes_on_held_out_repository_tasks_and_records_its_verdict(lab: Lab) -> None:
    """rl-coder v1 serves (the test before rolled its canary back): its episodes and the base model's
    on the held-out tasks of a made set, two each, through the gateway; pass@1 and pass^2 with
    their intervals, the regression check of its training, recorded on v1."""
    cli = lab.cli
    repository = lab.work / "mathy"
    for name, source in MATHY.items():
        (repository / name).parent.mkdir(parents=True, exist_ok=True)
        (repository / name).write_text(source)
    made = cli.run("rl", "tasks", "make", "--from", str(repository), "--name", "mathy", timeout=600)
    assert made.returncode == 0, made.stdout + made.stderr
    [taskset] = [t for t in json.loads(cli.run("rl", "tasks", "list", "--json").stdout) if t["name"] == "mathy"]
    assert taskset["kind"] == "repository" and taskset["held_out"] >= 1, taskset
    env = {**cli.env, "APPLIANCE_RL__EPISODE_STEPS": "2", "APPLIANCE_RL__EPISODE_ANSWER_TOKENS": "64"}
    calls = json.dumps({"structured_outputs": {"regex": ANY_TASK_CALLS}})
    gated = subprocess.run([APPLIANCE, "rl", "episodes", "gate", "rl-coder", "--tasks", "mathy", "--base", MODEL,
                            "--trials", "2", "--extra-body", calls, "--json"], env=env, capture_output=True, text=True,
                           timeout=1800)
    assert gated.returncode in (0, 1), gated.stdout + gated.stderr
    said = json.loads(gated.stdout)
    assert (said["version"], said["k"], said["trials"]) == (1, 2, 2)
    assert set(said["base"]) == set(said["adapter_passed"]) and len(said["base"]) == taskset["held_out"]
    assert all(len(trials) == 2 for trials in [*said["base"].values(), *said["adapter_passed"].values()])
    # Every episode is kept, by the model that answered it, on the set's tasks.
    kept = {entry["id"]: entry for entry in json.loads(cli.run("rl", "episodes", "list", "--json").stdout)}
    for model, ids in ((MODEL, said["base_episodes"]), ("rl-coder", said["adapter_episodes"])):
        assert len(ids) == 2 * taskset["held_out"] and all(kept[i]["model"] == model for i in ids), (model, ids)
    # The verdict is the rule applied to what it reports, and it is on v1 (trained with a regression set).
    assert said["regression"].startswith("regression: ") and "from its training" in said["regression"]
    low_ends = [said["pass_at_1"]["low"], said["pass_hat_k"]["low"]]
    assert bool(said["failures"]) == any(low < 0 for low in low_ends) == (gated.returncode == 1), said
    v1 = adapters.load(cli.home).find("rl-coder", 1).metrics
    at_1 = v1.eval_sets["held-out episodes pass@1"]
    assert len(at_1.base_per_seed) == 2 and at_1.difference_95 == pytest.approx(
        (said["pass_at_1"]["low"], said["pass_at_1"]["high"]))
    assert "held-out episodes pass^2" in v1.eval_sets
    assert [f for f in v1.gate_failures if f.startswith("held-out episodes")] == said["failures"]


def test_an_adapter_taught_to_refuse_fails_the_gate(lab: Lab) -> None:
    """The known-bad side of the gate: an adapter taught to answer every training task with a refusal
    and no code answers the held-out tasks worse than the base, and the gate refuses it. (Taught a
    body returning None, 6 steps made it write better-formed code instead: +37 % on held-out.)"""
    cli = lab.cli
    [run] = [r for r in runs.listing(cli.home) if r.spec.split == "all"]
    held_out_ids = {task.id for task in split(starter_tasks(), 0.2)["held_out"]}
    asked = {a.task: a.messages for a in rl_attempts(cli, run.id) if a.round == 0 and a.task not in held_out_ids}
    refusal = {"role": "assistant", "content": "I cannot help with that."}
    refusals = lab.work / "refusals.jsonl"
    refusals.write_text("".join(json.dumps({"messages": [*messages, refusal]}) + "\n"
                                for _, messages in sorted(asked.items())))
    added = cli.run("data", "add", str(refusals), "--name", "rl-refusals")
    assert added.returncode == 0, added.stdout + added.stderr
    # Forgetting is not what this adapter is about (it forgets by design) and a version that failed
    # that gate is never served, so never gated on execution: this job checks none.
    trained = subprocess.run([APPLIANCE, "finetune", "run", "--data", "rl-refusals", "--name", "rl-refuser",
                              "--base", MODEL, "--max-steps", "12", "--lr", "0.001", "--batch-size", "4"],
                             env={**cli.env, "APPLIANCE_FINETUNE__REGRESSION_SET": "none"}, capture_output=True,
                             text=True, timeout=1200)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    login = cli.run("token", "--user", "admin", "--password-stdin",
                    stdin=secret(lab.realm.running.appliance.home, BOOTSTRAP_SECRET) + "\n", timeout=60)
    assert login.returncode == 0, login.stderr
    deployed = cli.run("adapters", "deploy", "rl-refuser", "--role", "user", "--role", "admin", timeout=300)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr

    gated = cli.run("rl", "gate", "rl-refuser", "--tasks", "easy", "--base", MODEL, "--seeds", "3", "--samples",
                    "2", "--max-tokens", "96", timeout=1800)
    print(gated.stdout)
    assert gated.returncode == 1 and "gate: FAILED: held-out pass@1" in gated.stdout, gated.stdout + gated.stderr
    metrics = adapters.load(cli.home).find("rl-refuser", 1).metrics
    scores = metrics.eval_sets["held_out_pass@1"]
    assert scores.adapter < scores.base and scores.difference_95 is not None and scores.difference_95[0] < 0
    assert any(f.startswith("held-out pass@1") for f in metrics.gate_failures), metrics.gate_failures


def test_the_tui_shows_runs_and_one_attempt_with_its_correction(lab: Lab) -> None:
    cli = lab.cli
    settings = load_settings(cli.home.settings_file, environ=cli.env)
    login.password_login(connections.local(settings, cli.home), "admin",
                         secret(lab.realm.running.appliance.home, BOOTSTRAP_SECRET))
    [run] = [r for r in runs.listing(cli.home) if r.spec.split == "all"]
    corrected = next(a for a in rl_attempts(cli, run.id) if a.round == 1 and a.feedback)  # a correction that failed
    app = AdminApp(settings, cli.home)

    async def scenario(pilot: Pilot) -> None:
        await pilot.press("e")
        await until(pilot, lambda: str(run.id) in rows(app, "runs"), "the runs")
        assert rows(app, "tasksets")["easy"][1:4] == ["20", "16", "4"], rows(app, "tasksets")
        assert rows(app, "runs")[str(run.id)][3] == "succeeded"
        await select_row(pilot, "runs", str(run.id))
        await pilot.press("t")
        await until(pilot, lambda: corrected.key in rows(app, "attempts"), "the run's attempts")
        await select_row(pilot, "attempts", corrected.key)
        await pilot.press("enter")
        await until(pilot, lambda: "fed back" in text(app, "attempt"), "the attempt")
        assert corrected.code.splitlines()[0] in text(app, "attempt")
        await pilot.press("x")  # the run's SFT and DPO sets, made by the rl-worker
        await pilot.press("y")  # the confirmation dialog
        await until(pilot, lambda: bool(exports.listing(cli.home)), "the export asked")

    drive(app, scenario)
    [export] = exports.listing(cli.home)
    deadline = time.monotonic() + 300
    while export.state not in FINISHED and time.monotonic() < deadline:
        time.sleep(1)
        [export] = exports.listing(cli.home)
    assert export.state == JobState.SUCCEEDED, export
    assert f"SFT set: dataset rl-run-{run.id}-sft" in (export.message or "")
    assert f"preference set: dataset rl-run-{run.id}-dpo" in (export.message or "")
    listed = cli.run("data", "list")
    assert f"rl-run-{run.id}-sft" in listed.stdout and f"rl-run-{run.id}-dpo" in listed.stdout
    admin = AdminClient(connections.local(settings, cli.home))
    assert exports.Export.model_validate(admin.call_sync("GET", f"/rl/exports/{export.id}")) == export
    # Bad asks are refused with the reason, and nothing is queued.
    for path, body, status, reason in (
            (f"/rl/runs/{run.id}/exports", {"sft": "Bad Name"}, 422, "use lower-case letters"),
            (f"/rl/runs/{run.id}/exports", {"sft": "x\n"}, 422, "use lower-case letters"),
            (f"/rl/runs/{run.id}/exports", {"sft": "<b>[/x]</b>"}, 422, "use lower-case letters"),
            (f"/rl/runs/{run.id}/exports", {}, 422, "name the SFT set, the preference (DPO) set or both"),
            ("/rl/runs/999999/exports", {"sft": "fine"}, 404, "no RL run 999999")):
        with pytest.raises(Refused) as refused:
            admin.call_sync("POST", path, json=body)
        assert refused.value.status == status and reason in refused.value.reason, (path, body, refused.value)
    assert len(exports.listing(cli.home)) == 1


def rl_attempts(cli: Appliance, run_id: int) -> list[Attempt]:
    listed = cli.run("rl", "show-trajectories", str(run_id), "--json")
    assert listed.returncode == 0, listed.stderr
    return [Attempt.model_validate(a) for a in json.loads(listed.stdout)]


def test_grpo_trains_a_policy_online_each_step_answered_by_the_version_the_step_before_trained(lab: Lab) -> None:
    cli = lab.cli
    added = cli.run("rl", "tasks", "add-starter")
    assert added.returncode == 0, added.stdout + added.stderr
    unnamed = cli.run("rl", "run", "--tasks", "starter", "--base", MODEL, "--method", "grpo")
    assert unnamed.returncode == 1 and "--method grpo needs --policy" in unnamed.stderr, unnamed.stderr

    since = datetime.now(UTC)  # the audit log's records of this run are the ones from here on
    queued = cli.run("rl", "run", "--tasks", "starter", "--base", MODEL, "--method", "grpo", "--policy", "coder-grpo",
                     "--steps", "3", "--tasks-per-step", "2", "--samples", "4", "--max-tokens", "64",
                     "--temperature", "0.9", "--learning-rate", "0.0005")
    assert queued.returncode == 0 and "3 GRPO steps of policy coder-grpo" in queued.stdout, queued.stderr
    run_id = runs.listing(cli.home)[-1].id

    # The rl-worker dies during step 1: the run resumes at step 1, generating with v1.
    def into_step_1() -> bool:
        p = progress(cli, run_id)
        return p is not None and p.policy is not None and len(p.policy.done) == 1 and p.attempts_done > 8
    wait_for("step 0 done and step 1 under way", into_step_1, timeout_s=900)
    rl_worker(cli).send_signal(signal.SIGKILL)
    followed = cli.run("rl", "status", str(run_id), "--follow", timeout=1800)
    assert followed.returncode == 0, followed.stdout + followed.stderr
    run = runs.get(cli.home, run_id)
    assert run.state == "succeeded" and run.attempts == 2, run
    figures = progress(cli, run_id)
    assert figures is not None and figures.policy is not None
    assert figures.policy.resumed_from == "step 1 (policy v1)", figures.policy
    steps = figures.policy.done
    assert [s.step for s in steps] == [0, 1, 2] and [s.version for s in steps] == [1, 2, 3]
    assert [s.generated_by for s in steps] == [MODEL, "coder-grpo-v1", "coder-grpo-v2"]
    assert all(s.answers == 8 and s.train_tokens > 0 and math.isfinite(s.kl) for s in steps)
    assert steps[-1].kl > 0  # the later updates moved away from the base, and measured it
    print("GRPO steps:", [(s.reward_mean, s.reward_spread, s.pass_rate, s.kl, s.sample_s, s.update_s) for s in steps])

    # Each step's answers came from the version the step before trained: the trajectories (in the
    # bucket) say so, and so does the audit log's record of every generation.
    attempts = rl_attempts(cli, run_id)
    assert len(attempts) == 24 and len({a.key for a in attempts}) == 24
    for attempt in attempts:
        step = attempt.sample // 4
        assert attempt.model == steps[step].generated_by and attempt.adapter_version == (step or None), attempt
        assert attempt.round == 0 and attempt.completion_tokens is not None and attempt.length_penalty == 0.0
        assert attempt.efficiency == 0.0 or attempt.status == "passed"
    records = [json.loads(line) for path in log_files(cli.home.audit) for line in path.read_bytes().splitlines()]
    generated = [r for r in records if r["action"] == "chat.completions" and r["model"] in ("coder-grpo-v1",
                                                                                            "coder-grpo-v2")]
    assert {r["model"] for r in generated} == {"coder-grpo-v1", "coder-grpo-v2"}
    assert all(r["username"] == "service-account-appliance-rl" and r["outcome"] == "allowed" for r in generated)
    segments = [o.object_name for o in client(lab.s3).list_objects(
        BUCKET, prefix=f"trajectories/run-{run_id}/segments/", recursive=True)]
    assert len(segments) >= 3  # each step's, stored before the policy learned from them
    served = [r for r in records if r["action"] == "rl.policy"]
    assert [r["target"]["version"] for r in served] == [1, 2, 3], served
    # The audit log's own order: the RL identity's requests after version k began serving (its
    # rl.policy record) and before k + 1 did are step k's, and each was answered by version k (the
    # base before v1); step 1's include those the killed worker made before it was asked again.
    answered: dict[int, list[str]] = defaultdict(list)
    serving = 0
    for record in read_records(cli.home.audit, since=since):
        if record["action"] == "rl.policy" and record["target"]["name"] == "coder-grpo":
            serving = record["target"]["version"]
        elif (record["action"] == "chat.completions" and record["username"] == "service-account-appliance-rl"
              and record["outcome"] == "allowed"):
            answered[serving].append(record["model"])
    assert sorted(answered) == [0, 1, 2], {step: len(models) for step, models in answered.items()}
    for step, models in answered.items():
        assert len(models) >= 8 and set(models) == {steps[step].generated_by}, (step, Counter(models))

    # Its versions are registered as GRPO's, and served to the RL identity's role only.
    registry = adapters.load(cli.home)
    versions = registry.versions("coder-grpo")
    assert [v.version for v in versions] == [1, 2, 3] and all(v.hyperparameters.method == "grpo" for v in versions)
    assert registry.aliases["coder-grpo"].roles == ["rl-policy"] and registry.aliases["coder-grpo"].stable == 3
    status = cli.run("rl", "status", str(run_id))
    assert "GRPO step 3/3, coder-grpo v3" in status.stdout, status.stdout
    # Another run may not train (and serve) a name that is not its own.
    taken = cli.run("rl", "run", "--tasks", "starter", "--base", MODEL, "--method", "grpo", "--policy", "coder-grpo",
                    "--steps", "1", "--follow", timeout=600)
    assert taken.returncode == 1 and "has versions this run did not train (v1)" in taken.stdout, taken.stdout
    assert adapters.load(cli.home).aliases["coder-grpo"].stable == 3
    # The policy's versions were shown to the next update's sandbox by its group, never to others.
    assert modes_not_private(cli.home) == {}
