"""The training job queue: one SQLite table in the state dir, shared by `appliance finetune
submit|status|cancel`, the supervised `finetune-worker` and the admin API. A job's files (its data,
checkpoints, progress and result) live in its own directory; the row holds its state.

A job's life is a state machine (MOVES), moved by the appliance's one work queue (appliance.queue):
every change of state is checked against it inside the transaction that makes it, so two processes
cannot both move a job, and an illegal move raises IllegalTransition naming the state and the move:

    queued --claim--> running --finish--> succeeded | failed | cancelled
       |                 |  ^ (resumed by another worker after its worker died)
       |               cancel
       |                 v
       +--cancel--> cancelled <--finish-- cancelling (its worker stops the trainer, checkpoints kept)

A job whose workers died MAX_ATTEMPTS times (the watchdog ends a worker whose job made no progress
for `watchdog.training_stall_s`) fails instead of being taken again.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import stat
import zlib
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from appliance import queue
from appliance.durable import replace_file
from appliance.home import Home
from appliance.queue import Alive, Lifecycle, Queue
from appliance.records import HostName


class JobState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    CANCELLING = "cancelling"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


FINISHED = (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)
MOVES: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.CANCELLED}),
    JobState.RUNNING: frozenset({JobState.RUNNING, JobState.CANCELLING, *FINISHED}),
    JobState.CANCELLING: frozenset({JobState.CANCELLING, *FINISHED}),
    **{state: frozenset() for state in FINISHED},
}
HELD = frozenset({JobState.RUNNING, JobState.CANCELLING})  # a worker holds the job
# The columns of every table of JobState items (training jobs, RL runs and exports): appliance.queue
# moves them.
# The Unix time a JobState item was submitted (its `submitted` column, ISO 8601 with its offset).
SUBMITTED_AT = "cast(strftime('%s', submitted) as real)"
STATE_COLUMNS = """
    state text not null,           -- JobState, moved by MOVES
    submitted text not null,
    started text,
    finished text,
    attempts integer not null default 0,  -- times a worker took it up (more than one: it was resumed)
    worker_pid integer,
    message text,                  -- the outcome, or why it failed
    lease_until real,              -- appliance.queue: the worker's claim holds until then (null: while it lives)
    progress_at real               -- appliance.queue: the claim, or its claimer's last progress since"""

NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,63}$"  # an adapter's or a dataset's name


def name_problem(name: str) -> str | None:
    """What is wrong with an adapter's or a dataset's name, if anything."""
    if re.fullmatch(NAME_PATTERN, name):
        return None
    return "use lower-case letters, digits, '.', '_' or '-' (up to 64, starting with a letter or digit)"
CANCEL_FILE = "cancel"  # in the job's directory: the runner stops the trainer
PROGRESS_FILE = "progress.json"  # in the job's directory: the trainer's latest report
HEARTBEAT_FILE = "heartbeat"  # in the job's directory: the trainer touches it as it works (steps, evaluation)
PROGRESS_MAX_BYTES = 4096
RANKS_DIR = "ranks"  # in the job's directory: each training process's memory report, rank-N.json
MAX_RANK_REPORTS = 4096  # read at most, by name
LAUNCH_FILE = "launch.json"  # in the job's directory, the runner's: how it started the trainer (strategy, ranks)
SCHEMA = f"""
create table if not exists jobs (
    id integer primary key autoincrement,
    name text not null,            -- the adapter's name
    data text not null,            -- the dataset's name
    base text not null,            -- 'demo' or a checkpoint directory
    hyperparameters text not null, -- JSON
    eval_sets text not null,       -- JSON: kind -> items (finetune.evalsets)
    trainer_pid integer,           -- the sandboxed training process
{STATE_COLUMNS}
);"""
MAX_ATTEMPTS = 3  # workers that took a job or an RL run (each past the first found the last dead)


def given_up(attempts: int, state: JobState) -> tuple[JobState, dict[str, object]]:
    """How a job or an RL run whose workers died `attempts` times ends (appliance.queue): failed,
    or cancelled if a cancel had been asked."""
    if state == JobState.CANCELLING:
        return JobState.CANCELLED, {"message": f"cancelled; its worker had died {attempts} times", "finished": now()}
    return JobState.FAILED, {"message": f"given up after {attempts} attempts: each one's worker died or was ended "
                                        "by the watchdog for making no progress", "finished": now()}


# A job left by a worker that died is taken over in its state: it resumes from its last checkpoint.
JOBS = Queue(table="jobs", lifecycle=Lifecycle("training job", MOVES), waiting=JobState.QUEUED,
             taken=JobState.RUNNING, held=HELD, hint="`appliance finetune status` lists them",
             waiting_since=SUBMITTED_AT, max_attempts=MAX_ATTEMPTS, give_up=given_up)


class Hyperparameters(BaseModel):
    """How a job trains its adapter (LoRA, or QLoRA on a 4-bit base)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int = Field(8, ge=1, description="LoRA rank.")
    alpha: int = Field(16, ge=1, description="LoRA alpha (the update is scaled by alpha / rank).")
    dropout: float = Field(0.05, ge=0, lt=1)
    learning_rate: float = Field(2e-4, ge=0)
    epochs: float = Field(1.0, ge=0)
    max_steps: int = Field(-1, description="> 0 overrides epochs.")
    batch_size: int = Field(4, ge=1)
    max_length: int = Field(512, ge=16, description="Tokens per training row (longer rows are cut).")
    save_steps: int = Field(10, ge=1, description="Checkpoint every this many steps (a resume starts there).")
    qlora: bool = False
    seed: int = 0
    method: Literal["sft", "dpo", "grpo"] = Field(
        "sft", description="SFT on chat or text rows, DPO on preference rows (prompt, chosen, rejected); grpo: "
        "a policy version an online RL run trained (`appliance rl run --method grpo`), never a job's.")
    beta: float = Field(0.1, gt=0, description="DPO and GRPO: how far the adapter may move from the base model.")
    processes: int | None = Field(None, ge=1, description="Training processes (ranks) on each host; unset: "
                                  "finetune.processes.")
    hosts: list[HostName] = Field(default_factory=list, max_length=255, description=(
        "Joined worker hosts that train beside the head, sharded over all their processes; empty: the head alone."))


class Job(BaseModel):
    id: int
    name: str
    data: str
    base: str
    hyperparameters: Hyperparameters
    eval_sets: dict[str, list[dict[str, Any]]]
    state: JobState
    submitted: str
    started: str | None
    finished: str | None
    attempts: int
    worker_pid: int | None
    trainer_pid: int | None
    message: str | None


class Phase(StrEnum):
    """Where a running job is: training its steps, in the evaluation gate (the held-out loss, then
    each evaluation set at each seed, base and adapter), or registering the adapter."""

    TRAINING = "training"
    EVALUATING = "evaluating"
    REGISTERING = "registering"


class Progress(BaseModel):
    """The job's latest report (PROGRESS_FILE in the job's directory; the trainer writes it while
    it trains and gates, the runner once it registers; the CLI, the admin API and the TUI read it)."""

    model_config = ConfigDict(frozen=True, ser_json_inf_nan="strings")  # a NaN loss stays valid JSON

    step: int
    max_steps: int
    loss: float | None
    tokens_per_s: float
    eta_s: float | None = Field(description="Seconds left in the phase: its steps, or its evaluations, at the "
                                            "rate so far.")
    phase: Phase = Phase.TRAINING
    evaluations: int = Field(0, ge=0, description="The gate's evaluations done (an evaluation set at one seed).")
    evaluations_total: int = Field(0, ge=0, description="The gate's evaluations in all: sets x seeds.")


def progress_line(p: Progress, *, running: bool) -> str:
    """A job's progress in one line: its phase and how far into it (with the phase's ETA) while
    it runs; how far it got once it has ended."""
    steps = f"step {p.step}/{p.max_steps}" + (f", loss {p.loss:.3f}" if p.loss is not None else "") \
        + f", {p.tokens_per_s:.0f} tokens/s"
    gate = f"gate {p.evaluations}/{p.evaluations_total} evaluations"
    eta = f", ETA {p.eta_s:.0f} s" if p.eta_s is not None else ""
    if not running:
        return steps if p.phase == Phase.TRAINING else f"{steps}; {gate}"
    if p.phase == Phase.TRAINING:
        return f"training: {steps}{eta}"
    if p.phase == Phase.EVALUATING:
        doing = (f"{p.evaluations}/{p.evaluations_total} evaluations (sets x seeds){eta}" if p.evaluations_total
                 else "held-out loss")
        return f"gate evaluating: {doing}; trained {p.step}/{p.max_steps} steps"
    return f"registering the adapter; {steps}; {gate}"


class RankMemory(BaseModel):
    """One training process's report of what it holds (RANKS_DIR/rank-N.json in the job's
    directory, written by the rank itself): its shards of the base and of the adapter, its
    optimizer state and its peak resident memory."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int = Field(ge=0)
    host: str = Field(max_length=255)
    pid: int
    base_parameter_bytes: int = Field(ge=0)
    adapter_parameter_bytes: int = Field(ge=0)
    optimizer_bytes: int = Field(ge=0)
    peak_rss_bytes: int = Field(ge=0)


class Launch(BaseModel):
    """How the runner started the job's trainer (LAUNCH_FILE): the strategy, the processes on this
    host, the tokens of the rows it trains on (their longest, at most --max-length) and the
    training planner's estimate of one process's memory for them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    strategy: Literal["fsdp", "ddp", "single"]
    processes: int = Field(ge=1)
    seq_len: int | None = Field(None, ge=1)
    estimated_process_bytes: int | None = Field(None, ge=0)


class HostPart(BaseModel):
    """A worker host's word on its part of a job over several hosts (its training node reports it;
    the head keeps the latest): its state and what each of its ranks reported."""

    model_config = ConfigDict(extra="forbid")

    job: int = Field(ge=0, description="The job's tag (part_tag), not its queue id.")
    node: int = Field(ge=1, le=255, description="The host's place in the job (0 is the head).")
    state: Literal["fetching", "running", "ended", "failed"]
    exit_code: int | None = None
    detail: str | None = Field(None, max_length=4096, pattern=r"^[^\x00-\x1f\x7f]*$")  # one line, shown as is
    ranks: list[RankMemory] = Field(default_factory=list, max_length=1024)
    progress: Progress | None = None  # as the host's first process saw the job: step, loss, tokens/s, ETA


class JobReport(Job):
    """A job with its trainer's latest progress, how it trains (`strategy`: fsdp, ddp or single; None
    before it starts), what each of its ranks on this host reported and, for a job over several
    hosts, each worker host's part (None before it reported): what the admin API answers and the
    TUI shows."""

    progress: Progress | None
    strategy: str | None = None
    estimated_process_bytes: int | None = None  # the training planner's, for the rows trained on
    ranks: list[RankMemory] = []
    hosts: dict[str, HostPart | None] = {}


def report(home: Home, job: Job) -> JobReport:
    directory = job_dir(home, job.id)
    launch = read_launch(directory)
    return JobReport(**job.model_dump(), progress=read_progress(directory),
                     strategy=launch.strategy if launch else None,
                     estimated_process_bytes=launch.estimated_process_bytes if launch else None,
                     ranks=read_ranks(directory), hosts=host_parts(home, job.hyperparameters.hosts, directory))


def memory_line(ranks: list[RankMemory], estimate: int | None) -> str:
    """This host's ranks against the training planner's estimate of one, short:
    `here: 2 ranks, peak 1.7 GiB a rank (estimated 1.6 GiB)`."""
    if not ranks:
        return ""
    peak = max(rank.peak_rss_bytes for rank in ranks) / 2**30
    planned = f" (estimated {estimate / 2**30:.1f} GiB)" if estimate else ""
    return f"here: {len(ranks)} rank{'s' if len(ranks) != 1 else ''}, peak {peak:.1f} GiB a rank{planned}"


def hosts_line(parts: dict[str, HostPart | None]) -> str:
    """The worker hosts' parts of a job, short: `hosts: w1 running (2 ranks, peak 1.2 GiB), w2 fetching`."""
    def one(host: str, part: HostPart | None) -> str:
        if part is None:
            return f"{host} not reported"
        peak = max((rank.peak_rss_bytes for rank in part.ranks), default=0)
        ranks = f" ({len(part.ranks)} rank{'s' if len(part.ranks) != 1 else ''}, peak {peak / 2**30:.1f} GiB)" \
            if part.ranks else ""
        progress = f" {progress_line(part.progress, running=True)}" if part.progress and part.state == "running" \
            else ""
        return f"{host} {part.state}{progress}{ranks}"

    return "hosts: " + ", ".join(one(host, part) for host, part in parts.items()) if parts else ""


def part_tag(directory: Path) -> int:
    """A job over several hosts' number on the hosts (its network's names, its launches): the same
    for every run of the job's directory."""
    return zlib.crc32(str(directory).encode()) % 1_000_000


def training_dir(home: Home, host: str) -> Path:
    """The head's records of `host`'s parts of jobs (`host`: a name the host registry checked)."""
    return home.run / "training" / host


def record_part(home: Home, host: str, part: HostPart) -> None:
    """Keep `host`'s latest word on its part (the cluster listener checked that it has that part)."""
    directory = training_dir(home, host)
    directory.mkdir(parents=True, mode=0o700, exist_ok=True)
    replace_file(directory / f"{part.job}.report.json", part.model_dump_json().encode())


def host_parts(home: Home, hosts: list[str], directory: Path) -> dict[str, HostPart | None]:
    """Each worker host's latest word on its part of the job trained in `directory`."""
    tag, found = part_tag(directory), {}
    for host in hosts:
        content = _small_regular_file(training_dir(home, host) / f"{tag}.report.json", PROGRESS_MAX_BYTES)
        try:
            found[host] = HostPart.model_validate_json(content) if content is not None else None
        except ValueError:
            found[host] = None
    return found


def read_launch(directory: Path) -> Launch | None:
    """How the runner started the job's latest run; None before it did (or a file that is not one)."""
    found = _small_regular_file(directory / LAUNCH_FILE, PROGRESS_MAX_BYTES)
    try:
        return Launch.model_validate_json(found) if found is not None else None
    except ValueError:
        return None


def read_ranks(directory: Path) -> list[RankMemory]:
    """Each rank's latest memory report, by rank; a file that is not one (the trainer is not trusted)
    is left out."""
    ranks = directory / RANKS_DIR
    if ranks.is_symlink() or not ranks.is_dir():
        return []
    found = []
    for path in sorted(ranks.glob("rank-*.json"))[:MAX_RANK_REPORTS]:
        content = _small_regular_file(path, PROGRESS_MAX_BYTES)
        try:
            if content is not None:
                found.append(RankMemory.model_validate_json(content))
        except ValueError:
            continue
    return sorted(found, key=lambda r: r.rank)


def _small_regular_file(path: Path, max_bytes: int) -> bytes | None:
    """A regular file's bytes, if it is one of at most max_bytes (never through a link, nor waited on)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):  # before fdopen, which refuses a directory
        os.close(descriptor)
        return None
    with os.fdopen(descriptor, "rb") as handle:
        content = handle.read(max_bytes + 1)
    return content if len(content) <= max_bytes else None


def jobs_dir(home: Home) -> Path:
    return home.root / "finetune" / "jobs"


def job_dir(home: Home, job_id: int) -> Path:
    return jobs_dir(home) / str(job_id)


def database(home: Home) -> Path:
    """The queue database of training jobs, and of RL runs and exports (appliance.rl)."""
    return jobs_dir(home) / "jobs.sqlite"


def connect(home: Home) -> AbstractContextManager[sqlite3.Connection]:
    """A connection to the jobs' table in autocommit mode; `queue.immediate(db)` blocks are transactions."""
    return queue.connect(database(home), SCHEMA, JOBS)


def transaction(home: Home) -> AbstractContextManager[sqlite3.Connection]:
    """A write transaction on the jobs' table."""
    return queue.transaction(database(home), SCHEMA, JOBS)


def now() -> str:
    """The time, as the tables of JobState items keep it."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def claimed(db: sqlite3.Connection, items: Queue[JobState], worker_pid: int, alive: Alive) -> sqlite3.Row | None:
    """The row of the item a worker takes next from a table of JobState items (Queue.claim), when
    it first started kept."""
    key = items.claim(db, worker_pid, alive=alive, first={"started": now()})
    return None if key is None else items.row(db, key)


def request_cancel(db: sqlite3.Connection, items: Queue[JobState], key: int, directory: Path) -> None:
    """Cancel a queued item at once; a running one becomes `cancelling`, and CANCEL_FILE in its
    directory tells its worker to stop it."""
    if items.state_of(db, key) == JobState.QUEUED:
        items.move(db, key, JobState.CANCELLED, message="cancelled before it started", finished=now())
    else:
        items.move(db, key, JobState.CANCELLING, message="cancel requested")
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CANCEL_FILE).touch()  # the worker polls it


def _job(row: sqlite3.Row) -> Job:
    return Job(**{**dict(row), "hyperparameters": json.loads(row["hyperparameters"]),
                  "eval_sets": json.loads(row["eval_sets"])})


def submit(home: Home, *, name: str, data: str, base: str, hyperparameters: Hyperparameters,
           eval_sets: dict[str, list[dict[str, Any]]]) -> Job:
    with connect(home) as db:
        cursor = db.execute("insert into jobs (name, data, base, hyperparameters, eval_sets, state, submitted) "
                            "values (?, ?, ?, ?, ?, 'queued', ?)",
                            (name, data, base, hyperparameters.model_dump_json(), json.dumps(eval_sets), now()))
        return _job(JOBS.row(db, int(cursor.lastrowid or 0)))


def get(home: Home, job_id: int) -> Job:
    with connect(home) as db:
        return _job(JOBS.row(db, job_id))


def listing(home: Home) -> list[Job]:
    with connect(home) as db:
        return [_job(row) for row in JOBS.rows(db)]


def claim(home: Home, worker_pid: int, alive: Alive) -> Job | None:
    """The next job for this worker: one left running by a worker that died (it resumes from its
    last checkpoint; a cancelling one stays cancelling: its runner stops at once), else the oldest
    queued one."""
    with transaction(home) as db:
        row = claimed(db, JOBS, worker_pid, alive)
    return None if row is None else _job(row)


def progressed(home: Home, job_id: int, worker_pid: int) -> None:
    """The job's trainer reported progress (the watchdog's stall clock starts again)."""
    with connect(home) as db:
        JOBS.progressed(db, job_id, worker_pid)


def set_trainer(home: Home, job_id: int, pid: int) -> None:
    with connect(home) as db:
        db.execute("update jobs set trainer_pid = ? where id = ?", (pid, job_id))


def finish(home: Home, job_id: int, state: JobState, message: str) -> bool:
    """End a job; whether this ended it (False: it had already ended so, and keeps what it said
    then; ended otherwise: IllegalTransition)."""
    with transaction(home) as db:
        return JOBS.finish(db, job_id, state, message=message, finished=now(), trainer_pid=None)


def cancel(home: Home, job_id: int) -> Job:
    """A queued job is cancelled at once; a running one becomes `cancelling` and its worker stops
    it (within a second, checkpoints kept) and finishes it as cancelled."""
    with transaction(home) as db:
        request_cancel(db, JOBS, job_id, job_dir(home, job_id))
        return _job(JOBS.row(db, job_id))


def write_progress(directory: Path, progress: Progress) -> None:
    """Replace the job's progress report atomically (readers poll it). The partial file is made
    anew, never opened through what is there: the runner writes in a directory the trainer wrote."""
    partial = directory / f".{PROGRESS_FILE}.{os.getpid()}.partial"
    partial.unlink(missing_ok=True)
    with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "w") as handle:
        handle.write(progress.model_dump_json())
    os.replace(partial, directory / PROGRESS_FILE)


def read_progress(directory: Path) -> Progress | None:
    """The job's latest progress report, if it has made one."""
    # Written by the sandboxed trainer: a regular file of a few hundred bytes, or nothing.
    found = _small_regular_file(directory / PROGRESS_FILE, PROGRESS_MAX_BYTES)
    try:
        return Progress.model_validate_json(found) if found is not None else None
    except ValueError:  # not a report (a torn one cannot be: it is replaced whole)
        return None
