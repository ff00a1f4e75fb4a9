"""`appliance data ...` (import and list training datasets) and `appliance finetune ...` (train
adapters: queue jobs for the worker, follow and cancel them, or train in the foreground)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from appliance import adapters, jobs
from appliance.artifacts import artifact_store
from appliance.changes import note_target, records_change
from appliance.commands.common import AsJson, print_json
from appliance.datasets import check_name_free, load_registry, remove, verify_current, versions
from appliance.engine_launch import serves_adapters
from appliance.errors import ApplianceError, Invalid, NotFound
from appliance.home import Home
from appliance.model_refs import checkpoint
from appliance.progress import byte_progress
from appliance.settings import DEMO_MODEL, PoolSettings, Settings, load_settings
from appliance.terminal import Listing, text
from finetune import evalsets
from finetune.datasets import OnProgress, check, split, store
from finetune.follow import PhaseBar, follow
from finetune.over_hosts import worker_hosts
from finetune.runner import job_data, job_seq_len, run_job, size_job
from finetune.token_count import token_counter

data_app = typer.Typer(help="Training datasets: validated, scanned, stored content-addressed.",
                       no_args_is_help=True)
finetune_app = typer.Typer(help="Train LoRA/QLoRA adapters on stored datasets.", no_args_is_help=True)
out = Console()


@data_app.command("add")
@records_change("data.add")
def add(
    file: Annotated[Path, typer.Argument(help="JSONL (messages, or prompt/completion) or .txt.")],
    name: Annotated[str, typer.Option(help="Name to refer to the dataset by.")],
    model: Annotated[str, typer.Option(help="'demo' or a checkpoint directory: its tokenizer and chat "
                                            "template measure each row.")] = DEMO_MODEL,
    context: Annotated[int | None, typer.Option(min=1, help="Longest row in tokens "
                                                "(default: engine.max_model_len).")] = None,
    replace: Annotated[bool, typer.Option("--replace", help="Make this the new version of a dataset of that name "
                                          "(without it, a name taken is refused).")] = False,
) -> None:
    """Check every row (format, length, sensitive data: every problem reported at once, by line),
    split train/eval, store; all or nothing."""
    note_target("dataset", name)
    check_name_option("--name", name)
    home = Home.from_env()
    settings = load_settings(home.settings_file)
    check_name_free(load_registry(home), name, replace)  # before the long checks, not after them
    with _progress() as progress:
        progress("loading the tokenizer", 0, 0)
        counter = token_counter(checkpoint(model, home, settings, what="--model"))
        checked = check(file, counter, context or settings.engine.max_model_len, settings.compliance, progress)
    train, evaluation = split(checked.rows, settings.finetune.eval_fraction)
    done = store(name, file, train, evaluation, checked.sensitive, settings.compliance.training_data,
                 artifact_store(settings.artifacts, home), home, replace=replace)
    note_target("dataset", name, version=done.digest)
    found = ", ".join(f"{kind} {count}" for kind, count in sorted(checked.sensitive.items())) or "none"
    out.print(f"dataset {done.name}: {done.rows} rows ({done.train} train, {done.eval} eval), sha256 {done.digest}; "
              f"sensitive data: {found} ({done.action})", soft_wrap=True, markup=False)


@data_app.command("list")
def list_datasets(as_json: AsJson = False) -> None:
    """Datasets by name and content hash."""
    registry = load_registry(Home.from_env())
    if as_json:
        print_json([{"name": name, "sha256": digest} for name, digest in sorted(registry.items())])
        return
    table = Listing("name", "sha256")
    for name, digest in sorted(registry.items()):
        table.add_row(name, digest)
    out.print(table, crop=False)


@data_app.command("show")
def show(name: Annotated[str, typer.Argument(help="A dataset name from `appliance data list`.")],
         as_json: AsJson = False) -> None:
    """A dataset's versions (newest first), their rows and what their checks found; the files of
    the version in use are checked against its content hash."""
    home = Home.from_env()
    artifacts = artifact_store(load_settings(home.settings_file).artifacts, home)
    found = versions(home, artifacts, name)
    verify_current(home, artifacts, name)
    if as_json:
        print_json({"name": name, "versions": found})
        return
    table = Listing("sha256", "in use", "created", "source", "kind", "rows", "train", "eval", text("sensitive data"))
    for version in found:
        sensitive = ", ".join(f"{kind} {n}" for kind, n in sorted(version.sensitive.items())) or "none"
        table.add_row(version.sha256[:16], "yes" if version.current else "", version.created, version.source,
                      version.kind or "-", str(version.rows), str(version.train), str(version.eval),
                      f"{sensitive} ({version.sensitive_action})")
    out.print(table, crop=False)
    out.print(f"dataset {name}: files of the version in use match its sha256", markup=False, highlight=False)


@data_app.command("remove")
@records_change("data.remove")
def remove_dataset(name: Annotated[str, typer.Argument(help="A dataset name from `appliance data list`.")]) -> None:
    """Forget a dataset and delete its stored versions; refused while a queued or running training
    job uses it."""
    note_target("dataset", name)
    home = Home.from_env()
    gone = remove(home, artifact_store(load_settings(home.settings_file).artifacts, home), name)
    out.print(f"dataset {name} removed ({len(gone)} stored versions deleted)", markup=False, highlight=False)



@contextmanager
def _progress() -> Iterator[OnProgress]:
    """A progress bar on standard error for the checks of `data add` when it is a terminal;
    nothing otherwise (a script's log gets no bar redraws)."""
    if not sys.stderr.isatty():
        yield lambda what, done, total: None
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("checking", total=None)

        def show(what: str, done: int, total: int) -> None:
            bar.update(task, description=what, completed=done, total=total or None)

        yield show


def _hyperparameters(qlora: bool, rank: int, alpha: int, lr: float, epochs: float, max_steps: int, batch_size: int,
                     save_steps: int, method: str, beta: float, processes: int | None,
                     max_length: int, hosts: str | None = None) -> jobs.Hyperparameters:
    if method not in ("sft", "dpo"):
        raise Invalid(f"--method {method!r}: sft or dpo")
    names = [] if hosts is None else [name.strip() for name in hosts.split(",")]
    try:
        return jobs.Hyperparameters(rank=rank, alpha=alpha, learning_rate=lr, epochs=epochs, max_steps=max_steps,
                                    batch_size=batch_size, save_steps=save_steps, qlora=qlora,
                                    method="dpo" if method == "dpo" else "sft", beta=beta, processes=processes,
                                    max_length=max_length, hosts=names)
    except ValidationError as exc:
        raise Invalid(f"--hosts {hosts!r}: host names separated by commas (as `appliance hosts list` shows them), "
                      "or all") from exc


def check_name_option(option: str, name: str) -> None:
    """An adapter's or a dataset's name given as `option`, or why not."""
    if problem := jobs.name_problem(name):
        raise Invalid(f"{option} {name!r}: {problem}")


def _check(name: str, data: str, base: str, home: Home, hp: jobs.Hyperparameters) -> jobs.Hyperparameters:
    """What can be known wrong before a job is queued or run: the names, the hosts, and whether it
    fits here; `hp` with its hosts named (`all`: the hosts joined now)."""
    check_name_option("--name", name)
    registry = load_registry(home)
    if data not in registry:
        raise NotFound(f"no dataset named {data!r}",
                       hint=f"datasets: {', '.join(sorted(registry)) or 'none'}")
    settings = load_settings(home.settings_file)
    if hp.hosts:
        hp = hp.model_copy(update={"hosts": [host.name for host in worker_hosts(home, settings, hp.hosts)]})
    model = checkpoint(base, home, settings, what="--base").resolve()
    _, splits = job_data(home, artifact_store(settings.artifacts, home), data, hp)
    size_job(model, hp, settings.finetune, seq_len=job_seq_len(model, hp, splits))
    warning = deploy_warning(settings, adapters.load(home).aliases.get(name), name,
                             lambda pool: serves_adapters(pool, settings, home))
    if warning is not None:
        Console(stderr=True).print(warning, markup=False, highlight=False)
    return hp


def deploy_warning(settings: Settings, alias: adapters.Alias | None, name: str,
                   serves: Callable[[PoolSettings], bool]) -> str | None:
    """What to tell someone about to train `name` whose pool would not serve it (`serves`: whether a
    pool serves adapters, appliance.engine_launch.serves_adapters)."""
    served_on = adapters.deploy_pool(alias, [pool.name for pool in settings.pools])
    pool = next((pool for pool in settings.pools if pool.name == served_on), None)
    if pool is None or serves(pool):
        return None
    return (f"warning: engine pool {pool.name!r}, where {name} would deploy, does not serve adapters: the adapter "
            f"will train but not deploy until `appliance settings set pools.{pool.name}.enable_lora true` and "
            "`appliance settings apply`")


# Options shared by `submit` and `run`; their defaults are a job's (jobs.Hyperparameters says them once).
HP = jobs.Hyperparameters()
Data = Annotated[str, typer.Option(help="A dataset name from `appliance data list`.")]
Name = Annotated[str, typer.Option(help="Adapter name; each run registers its next version.")]
Base = Annotated[str, typer.Option(help="'demo', a served model's name or a checkpoint directory.")]
QLoRA = Annotated[bool, typer.Option(help="Load the base in 4-bit NF4 (bitsandbytes).")]
Rank = Annotated[int, typer.Option(min=1, help="LoRA rank: the adapter's size (8 or 16 is typical).")]
Alpha = Annotated[int, typer.Option(min=1, help="LoRA alpha: the update is scaled by alpha / rank.")]
LearningRate = Annotated[float, typer.Option(min=0, help="Learning rate, e.g. 2e-4.")]
Epochs = Annotated[float, typer.Option(min=0, help="Passes over the dataset (a fraction is allowed).")]
MaxSteps = Annotated[int, typer.Option(help="> 0 overrides --epochs.")]
BatchSize = Annotated[int, typer.Option(min=1, help="Rows per training step.")]
MaxLength = Annotated[int, typer.Option(min=16, help="Tokens per training row; longer rows are cut.")]
SaveSteps = Annotated[int, typer.Option(min=1, help="Checkpoint every N steps (a rerun resumes).")]
Method = Annotated[str, typer.Option(help="sft (chat or text rows) or dpo (preference rows: prompt, chosen, "
                                          "rejected).")]
Processes = Annotated[int | None, typer.Option(min=1, help="Training processes (ranks) on this host; more than one "
                                               "shards the base over them (finetune.strategy). Default: "
                                               "finetune.processes, else one per visible GPU, at least one.")]
Beta = Annotated[float, typer.Option(min=0.001, help="DPO: how far the adapter may move from the base model.")]
Hosts = Annotated[str | None, typer.Option(help="Joined hosts that train beside this one, HOST[,HOST...] or all: "
                                           "the base is sharded over every process of every host (root only).")]
Scenarios = Annotated[Path | None, typer.Option(help="JSONL of prompts with expected answers the adapter should "
                                                "get right (gated on finetune.gate_min_scenario_score).")]
Regression = Annotated[Path | None, typer.Option(help="JSONL of general prompts with expected answers, to catch "
                                                 "forgetting (gated on finetune.gate_max_regression_drop).")]


def _eval_sets(scenarios: Path | None, regression: Path | None) -> dict[str, list[dict[str, Any]]]:
    return {kind: evalsets.parse(path) for kind, path in (("scenarios", scenarios), ("regression", regression)) if path}


@finetune_app.command("submit")
@records_change("finetune.submit")
def submit(data: Data, name: Name, base: Base = DEMO_MODEL, qlora: QLoRA = HP.qlora, rank: Rank = HP.rank,
           alpha: Alpha = HP.alpha, lr: LearningRate = HP.learning_rate, epochs: Epochs = HP.epochs,
           max_steps: MaxSteps = HP.max_steps, batch_size: BatchSize = HP.batch_size,
           save_steps: SaveSteps = HP.save_steps, scenarios: Scenarios = None, regression: Regression = None,
           method: Method = HP.method, beta: Beta = HP.beta, processes: Processes = HP.processes,
           max_length: MaxLength = HP.max_length, hosts: Hosts = None) -> None:
    """Queue a training job for the finetune-worker; follow it with `appliance finetune status -f`."""
    home = Home.from_env()
    hp = _hyperparameters(qlora, rank, alpha, lr, epochs, max_steps, batch_size, save_steps, method, beta, processes,
                          max_length, hosts)
    hp = _check(name, data, base, home, hp)
    job = jobs.submit(home, name=name, data=data, base=base, hyperparameters=hp,
                      eval_sets=_eval_sets(scenarios, regression))
    note_target("job", str(job.id))
    out.print(f"job {job.id} queued: adapter {name} on dataset {data} (base {base})")


@finetune_app.command("status")
def status(
    job: Annotated[int | None, typer.Argument(help="A job id (default: every job).")] = None,
    follow_job: Annotated[bool, typer.Option("--follow", "-f", help="Show the job's progress until it ends: a bar "
                                             "on a terminal, a line per change through a pipe.")] = False,
    as_json: AsJson = False,
) -> None:
    """Training jobs: state, phase and progress (training: step, loss, tokens/s; the gate: evaluations done
    of sets x seeds; registering), the phase's ETA, and outcome."""
    home = Home.from_env()
    if follow_job:
        if job is None or as_json:
            raise ApplianceError("--follow needs a job id, and shows its progress as it changes, not JSON")
        follow(home, job, out)
        return
    listed = [jobs.get(home, job)] if job is not None else jobs.listing(home)
    if as_json:
        print_json([jobs.report(home, found) for found in listed])
        return
    table = Listing("job", "adapter", "dataset", "state", text("progress"), "submitted", text("outcome"))
    for found in listed:
        table.add_row(str(found.id), found.name, found.data, found.state, _progress_text(home, found),
                      found.submitted, found.message or "")
    out.print(table, crop=False)


@finetune_app.command("cancel")
@records_change("finetune.cancel")
def cancel(job: Annotated[int, typer.Argument(help="A job id.")]) -> None:
    """Cancel a queued job, or stop a running one (its checkpoints stay)."""
    note_target("job", str(job))
    found = jobs.cancel(Home.from_env(), job)
    out.print(f"job {job}: "
              f"{'cancelled' if found.state == jobs.JobState.CANCELLED else 'stopping (its checkpoints stay)'}")


@finetune_app.command("run")
@records_change("adapter.train")
def run(data: Data, name: Name, base: Base = DEMO_MODEL, qlora: QLoRA = HP.qlora, rank: Rank = HP.rank,
        alpha: Alpha = HP.alpha, lr: LearningRate = HP.learning_rate, epochs: Epochs = HP.epochs,
        max_steps: MaxSteps = HP.max_steps, batch_size: BatchSize = HP.batch_size,
        save_steps: SaveSteps = HP.save_steps, scenarios: Scenarios = None, regression: Regression = None,
        method: Method = HP.method, beta: Beta = HP.beta, processes: Processes = HP.processes,
        max_length: MaxLength = HP.max_length, hosts: Hosts = None) -> None:
    """Train an adapter in the foreground (as the worker would), gate it, register it."""
    note_target("adapter", name)
    home = Home.from_env()
    hp = _hyperparameters(qlora, rank, alpha, lr, epochs, max_steps, batch_size, save_steps, method, beta, processes,
                          max_length, hosts)
    hp = _check(name, data, base, home, hp)
    sets = _eval_sets(scenarios, regression)
    settings = load_settings(home.settings_file)
    work = home.root / "finetune" / f"{name}-{load_registry(home)[data][:12]}"
    with byte_progress() as progress:
        bar = PhaseBar(progress)
        bar.show("training", None)
        outcome = run_job(work, name=name, data=data, base=base, hp=hp, settings=settings, home=home,
                          eval_sets=sets, on_progress=lambda p: bar.show(jobs.progress_line(p, running=True), p))
    result, record = outcome.result, outcome.record
    note_target("adapter", record.name, version=record.version)
    resumed = f" (resumed from {result.resumed_from})" if result.resumed_from else ""
    scores = "".join(f"; {scores.line(kind)}" for kind, scores in record.metrics.eval_sets.items())
    out.print(f"adapter {record.name} v{record.version}: held-out loss {result.base_eval_loss:.4f} -> "
              f"{result.adapter_eval_loss:.4f} ({result.improvement:+.1%}){scores}; {result.steps} steps{resumed}; "
              f"gate: {'passed' if outcome.passed else 'FAILED'}; {record.artifact}", soft_wrap=True)
    if not outcome.passed:
        raise ApplianceError(f"adapter {name} v{record.version} failed the evaluation gate: "
                             + "; ".join(outcome.failures))


def _progress_text(home: Home, job: jobs.Job) -> str:
    directory = jobs.job_dir(home, job.id)
    p = jobs.read_progress(directory)
    line = "" if p is None else jobs.progress_line(p, running=job.state == jobs.JobState.RUNNING)
    launch = jobs.read_launch(directory)
    memory = jobs.memory_line(jobs.read_ranks(directory), launch.estimated_process_bytes if launch else None)
    hosts = jobs.hosts_line(jobs.host_parts(home, job.hyperparameters.hosts, directory))
    return "; ".join(part for part in (line, memory, hosts) if part)
