"""A training job's progress through its phases: the gate's evaluations (sets x seeds) reported as
each is done with an ETA from their rate, the runner's registering phase, the one line that
`finetune status`, the admin API and the follower show, and the follower through a pipe (a plain
line per change, as it happens) or on a terminal (a bar with the phase's own total)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from pydantic import TypeAdapter
from rich.console import Console
from rich.progress import Progress as Bars
from textual.pilot import Pilot
from typer.testing import CliRunner

from appliance import cli, jobs
from appliance.home import HOME_ENV, Home
from appliance.jobs import Phase, Progress
from appliance.progress import byte_progress
from finetune import cli as finetune_cli
from finetune import follow
from finetune.phases import Phases
from finetune.runner import record_registering
from finetune.train import Result, scores_over_seeds
from serve.routes import jobs as jobs_routes
from tests.support.waiting import until

if TYPE_CHECKING:
    from tui.app import AdminApp

TRAINED = Progress(step=30, max_steps=30, loss=0.912, tokens_per_s=850.0, eta_s=0.0)
GATING = Progress(step=30, max_steps=30, loss=0.912, tokens_per_s=850.0, eta_s=140.0, phase=Phase.EVALUATING,
                  evaluations=3, evaluations_total=6)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_gate_records_each_evaluation_as_it_is_done_with_an_eta_from_its_rate(tmp_path: Path) -> None:
    """Two sets at three seeds: six evaluations, each written to the job's progress report once
    its base and adapter answers are scored, never before."""
    clock, seen = Clock(), []
    phases = Phases(lambda p: jobs.write_progress(tmp_path, p), clock)
    phases.trained(TRAINED)
    evaluated = phases.gate(6, step=30, max_steps=30)
    started = jobs.read_progress(tmp_path)
    assert started is not None and (started.phase, started.evaluations, started.evaluations_total) == \
        (Phase.EVALUATING, 0, 6)
    assert started.eta_s is None and started.loss == TRAINED.loss  # no rate yet: no ETA, never "ETA 0 s"

    def score(kind: str, seed: int, adapter: bool) -> float:
        report = jobs.read_progress(tmp_path)
        assert report is not None
        seen.append((kind, seed, adapter, report.evaluations))
        clock.now += 10.0  # each answer of a set takes 10 s: an evaluation (base and adapter) 20 s
        return 0.5 if adapter else 0.25

    scores = scores_over_seeds({"scenarios": [{}], "regression": [{}]}, 3, score, evaluated)
    assert scores == {kind: {"base": [0.25] * 3, "adapter": [0.5] * 3} for kind in ("scenarios", "regression")}
    assert [done for *_, done in seen] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]  # one more after each pair
    assert [(kind, seed) for kind, seed, adapter, _ in seen if adapter] == [
        ("scenarios", 0), ("scenarios", 1), ("scenarios", 2), ("regression", 0), ("regression", 1), ("regression", 2)]
    done = jobs.read_progress(tmp_path)
    assert done is not None and (done.evaluations, done.eta_s) == (6, 0.0)


def test_the_gates_eta_is_the_evaluations_left_at_the_rate_so_far() -> None:
    clock, reports = Clock(), []
    evaluated = Phases(reports.append, clock).gate(4, step=10, max_steps=10)
    clock.now += 30.0
    evaluated()
    assert (reports[-1].evaluations, reports[-1].eta_s) == (1, 90.0)
    clock.now += 10.0
    evaluated()
    assert (reports[-1].evaluations, reports[-1].eta_s) == (2, 40.0)
    assert reports[-1].loss is None and reports[-1].tokens_per_s == 0.0  # no training step was reported


def test_an_evaluation_past_the_gates_total_is_refused() -> None:
    evaluated = Phases(lambda p: None).gate(1, step=1, max_steps=1)
    evaluated()
    with pytest.raises(ValueError, match="evaluation 2 of a gate of 1"):
        evaluated()


def result(steps: int = 30) -> Result:
    return Result(adapter_dir=Path("/nonexistent"), base_eval_loss=2.0, adapter_eval_loss=1.0, steps=steps,
                  train_tokens=1000, seconds=1.0, resumed_from=None)


def test_the_runner_records_registering_from_the_trainers_last_report(tmp_path: Path) -> None:
    passed: list[Progress] = []
    jobs.write_progress(tmp_path, GATING.model_copy(update={"evaluations": 6, "eta_s": 0.0}))
    record_registering(tmp_path, result(), passed.append)
    found = jobs.read_progress(tmp_path)
    assert found is not None and found == passed[0]
    assert (found.phase, found.evaluations, found.evaluations_total, found.step, found.eta_s) == \
        (Phase.REGISTERING, 6, 6, 30, None)


def test_without_a_report_the_runner_records_registering_from_the_result(tmp_path: Path) -> None:
    record_registering(tmp_path, result(steps=12), lambda p: None)
    found = jobs.read_progress(tmp_path)
    assert found is not None and (found.phase, found.step, found.max_steps) == (Phase.REGISTERING, 12, 12)


def test_the_runner_writes_no_file_through_a_link_the_trainer_left(tmp_path: Path) -> None:
    """The trainer writes the job's directory: a link where the runner's partial report goes is
    replaced, and what it points at is untouched."""
    victim = tmp_path / "victim"
    victim.write_text("mine")
    job = tmp_path / "job"
    job.mkdir()
    (job / f".{jobs.PROGRESS_FILE}.{os.getpid()}.partial").symlink_to(victim)
    record_registering(job, result(), lambda p: None)
    assert victim.read_text() == "mine"
    found = jobs.read_progress(job)
    assert found is not None and found.phase == Phase.REGISTERING


def test_a_report_that_cannot_be_written_is_logged_and_the_job_goes_on(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / jobs.PROGRESS_FILE).mkdir()  # left by the trainer: nothing can replace it
    assert jobs.read_progress(tmp_path) is None  # nor is it a report
    passed: list[Progress] = []
    record_registering(tmp_path, result(), passed.append)
    assert [p.phase for p in passed] == [Phase.REGISTERING]
    assert "the registering phase is not in its progress report" in caplog.text


@pytest.mark.parametrize(("progress", "running", "line"), [
    (Progress(step=12, max_steps=30, loss=1.234, tokens_per_s=850.0, eta_s=40.0), True,
     "training: step 12/30, loss 1.234, 850 tokens/s, ETA 40 s"),
    (GATING, True, "gate evaluating: 3/6 evaluations (sets x seeds), ETA 140 s; trained 30/30 steps"),
    (GATING.model_copy(update={"evaluations": 0, "eta_s": None}), True,
     "gate evaluating: 0/6 evaluations (sets x seeds); trained 30/30 steps"),
    (GATING.model_copy(update={"evaluations_total": 0, "evaluations": 0, "eta_s": None}), True,
     "gate evaluating: held-out loss; trained 30/30 steps"),
    (GATING.model_copy(update={"phase": Phase.REGISTERING, "evaluations": 6, "eta_s": None}), True,
     "registering the adapter; step 30/30, loss 0.912, 850 tokens/s; gate 6/6 evaluations"),
    (GATING, False, "step 30/30, loss 0.912, 850 tokens/s; gate 3/6 evaluations"),
    (Progress(step=3, max_steps=30, loss=None, tokens_per_s=0.0, eta_s=None), False, "step 3/30, 0 tokens/s"),
])
def test_a_jobs_progress_is_one_line_naming_its_phase(progress: Progress, running: bool, line: str) -> None:
    assert jobs.progress_line(progress, running=running) == line


def test_a_report_of_before_the_phases_reads_as_training(tmp_path: Path) -> None:
    (tmp_path / jobs.PROGRESS_FILE).write_text('{"step": 1, "max_steps": 2, "loss": 1.0, "tokens_per_s": 3.0, '
                                               '"eta_s": 4.0}')
    found = jobs.read_progress(tmp_path)
    assert found is not None and (found.phase, found.evaluations_total) == (Phase.TRAINING, 0)


def running_job(home: Home) -> jobs.Job:
    submitted = jobs.submit(home, name="support-lora", data="tickets", base="demo",
                            hyperparameters=jobs.Hyperparameters(), eval_sets={})
    claimed = jobs.claim(home, os.getpid(), lambda pid: True)
    assert claimed is not None and claimed.id == submitted.id
    return claimed


def test_status_and_the_admin_api_show_the_gates_progress(home: Home, monkeypatch: pytest.MonkeyPatch) -> None:
    job = running_job(home)
    jobs.job_dir(home, job.id).mkdir(parents=True)
    jobs.write_progress(jobs.job_dir(home, job.id), GATING)
    # The CLI's console took its width when first imported (80 without a terminal): a wide one, so that
    # the progress column is on one line.
    monkeypatch.setattr(finetune_cli.out, "width", 400)
    shown = CliRunner().invoke(cli.app, ["finetune", "status"], env={HOME_ENV: str(home.root)})
    assert shown.exit_code == 0, shown.output
    assert "gate evaluating: 3/6 evaluations (sets x seeds), ETA 140 s; trained 30/30 steps" in shown.output

    [listing] = [route for route in jobs_routes.router(home).routes if getattr(route, "name", "") == "jobs.list"]
    answered = TypeAdapter(list[jobs.JobReport]).dump_python(listing.endpoint(), mode="json")  # type: ignore[attr-defined]
    assert answered[0]["progress"] | {"loss": None} == {
        "step": 30, "max_steps": 30, "loss": None, "tokens_per_s": 850.0, "eta_s": 140.0, "phase": "evaluating",
        "evaluations": 3, "evaluations_total": 6}


def test_the_follower_through_a_pipe_prints_a_line_as_each_change_happens(home: Home,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Read from the pipe's other end while the follower runs: each line arrives when its change
    does (flushed, no bar), and a poll that finds nothing new prints nothing."""
    monkeypatch.setattr(follow, "POLL_S", 0.01)
    job = running_job(home)
    directory = jobs.job_dir(home, job.id)
    directory.mkdir(parents=True, exist_ok=True)
    reading, writing = os.pipe()
    received: list[str] = []
    ended: list[BaseException] = []

    def run() -> None:
        with os.fdopen(writing, "w") as pipe:
            try:
                follow.follow(home, job.id, Console(file=pipe, width=400))
            except BaseException as exc:  # typer.Exit: the job did not succeed
                ended.append(exc)

    def read() -> None:
        with os.fdopen(reading) as pipe:
            received.extend(iter(pipe.readline, ""))

    reader = threading.Thread(target=read)
    follower = threading.Thread(target=run)
    reader.start()
    follower.start()
    until(lambda: len(received) == 1, "the job's first line")
    assert received == [f"job {job.id}: running\n"]
    for count, progress in enumerate([TRAINED.model_copy(update={"step": 29, "eta_s": 2.0}), GATING,
                                      GATING.model_copy(update={"evaluations": 4, "eta_s": 90.0})], start=2):
        jobs.write_progress(directory, progress)
        until(lambda count=count: len(received) == count, f"line {count} of the follower")
        assert jobs.progress_line(progress, running=True) in received[-1]
    jobs.finish(home, job.id, jobs.JobState.FAILED, "adapter support-lora v1: gate FAILED")
    follower.join(timeout=60)
    reader.join(timeout=60)
    assert not follower.is_alive() and not reader.is_alive()
    assert received[1:] == [
        f"job {job.id}: running training: step 29/30, loss 0.912, 850 tokens/s, ETA 2 s\n",
        f"job {job.id}: running gate evaluating: 3/6 evaluations (sets x seeds), ETA 140 s; trained 30/30 steps\n",
        f"job {job.id}: running gate evaluating: 4/6 evaluations (sets x seeds), ETA 90 s; trained 30/30 steps\n",
        f"job {job.id} failed: adapter support-lora v1: gate FAILED\n"]
    assert not any("\x1b" in line or "\r" in line for line in received)  # no bar, no cursor moves
    assert [getattr(exc, "exit_code", None) for exc in ended] == [1]


def test_status_follow_of_an_ended_job_through_a_pipe_prints_its_outcome(home: Home) -> None:
    job = running_job(home)
    jobs.finish(home, job.id, jobs.JobState.SUCCEEDED, "adapter support-lora v1: gate passed")
    shown = CliRunner().invoke(cli.app, ["finetune", "status", str(job.id), "-f"], env={HOME_ENV: str(home.root)})
    assert shown.exit_code == 0 and shown.output == f"job {job.id} succeeded: adapter support-lora v1: gate passed\n"


def test_the_bar_on_a_terminal_counts_the_phases_own_total_never_0_of_0() -> None:
    shown = byte_progress()  # not started: the bars' columns are read, not drawn
    bar = follow.PhaseBar(shown)
    bar.show("job 1: running", None)
    assert amounts(shown) == [""]
    bar.show("training", TRAINED.model_copy(update={"step": 12}))
    assert amounts(shown) == ["12/30 steps"]
    bar.show("gate", GATING)
    assert amounts(shown) == ["3/6 evaluations"]  # a bar of its own: the training one is gone
    bar.show("gate", GATING.model_copy(update={"evaluations_total": 0, "evaluations": 0}))
    assert amounts(shown) == [""]
    bar.show("registering", GATING.model_copy(update={"phase": Phase.REGISTERING}))
    assert amounts(shown) == [""]


def amounts(bars: Bars) -> list[str]:
    """What the amount column shows for each bar."""
    column = bars.columns[2]
    return [str(column(task)) for task in bars.tasks]  # type: ignore[operator]


def test_the_tuis_jobs_screen_shows_each_jobs_phase_and_its_eta(home: Home) -> None:
    """Training, the gate (evaluations done of sets x seeds, its ETA) and registering, each on its
    job's row; an ended job shows the steps it trained and no ETA."""
    from tests.unit.test_tui import job, sample_answers, screen_lines, show, with_fake

    def reported(job_id: int, state: str, progress: Progress) -> dict[str, Any]:
        return {**job(job_id, state, name=f"bot-{job_id}"), "progress": progress.model_dump(mode="json")}

    answers = {**sample_answers(), "/jobs": [
        reported(1, "succeeded", GATING.model_copy(update={"phase": Phase.REGISTERING, "evaluations": 6})),
        reported(2, "running", TRAINED.model_copy(update={"step": 12, "eta_s": 40.0})),
        reported(3, "running", GATING),
        reported(4, "running", GATING.model_copy(update={"phase": Phase.REGISTERING, "eta_s": None}))]}

    async def scenario(pilot: Pilot[None], app: AdminApp, fake: object) -> None:
        await show(pilot, "j")
        rows = {line.split()[0]: line.split()[1:] for line in screen_lines(app)
                if line.split() and line.split()[0].isdigit()}
        assert rows["1"][:4] == ["bot-1", "succeeded", "step", "30/30"] and rows["1"][-1] == "-"
        assert rows["2"][2:5] == ["step", "12/30", "0.912"] and rows["2"][-1] == "0m40s"
        assert rows["3"][2:5] == ["gate", "3/6", "0.912"] and rows["3"][-1] == "2m20s"
        assert rows["4"][2:4] == ["registering", "0.912"] and rows["4"][-1] == "-"

    with_fake(home, answers, scenario)


def test_the_tuis_jobs_screen_names_each_host_s_part_of_a_job_over_hosts(home: Home) -> None:
    from tests.unit.test_tui import job, sample_answers, screen_lines, show, with_fake

    part = {"job": 1, "node": 1, "state": "running", "exit_code": None, "detail": None, "ranks": []}
    answers = {**sample_answers(), "/jobs": [
        {**job(5, "running", name="wide"), "progress": TRAINED.model_copy(update={"step": 3}).model_dump(mode="json"),
         "hosts": {"w1": part, "w2": None}}]}

    async def scenario(pilot: Pilot[None], app: AdminApp, fake: object) -> None:
        await show(pilot, "j")
        shown = " ".join(screen_lines(app))
        assert "step 3/30" in shown and "w1 running" in shown and "w2 not reported" in shown

    with_fake(home, answers, scenario)
