"""One training job from start to registered adapter, for the `finetune-worker` and for
`appliance finetune run` alike: the dataset laid out in the job's directory, the training in a
child process in the training sandbox (finetune.sandbox: its own user, only its files, no
network), then the evaluation gate and the registry. A job directory that already holds checkpoints
resumes from the last one."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

import psutil

from appliance.adapters import AdapterMetrics, AdapterRecord, AdapterState, Scores
from appliance.artifacts import ArtifactStore, artifact_store
from appliance.datasets import PREFIX, check_dataset, load_registry
from appliance.home import Home
from appliance.job_fit import CPU_MMAP_THRESHOLD, JobFit, JobShape, fit_job
from appliance.jobs import (
    CANCEL_FILE,
    HEARTBEAT_FILE,
    LAUNCH_FILE,
    PROGRESS_FILE,
    RANKS_DIR,
    Hyperparameters,
    Launch,
    Phase,
    Progress,
    read_progress,
    write_progress,
)
from appliance.model_refs import checkpoint
from appliance.orphans import group_members
from appliance.records import config_sha256
from appliance.settings import FinetuneSettings, Settings
from finetune import adapters, evalsets, over_hosts
from finetune.datasets import kind
from finetune.sandbox import TRAINER_ENVIRONMENT, prepare, sandbox_memory_bytes, sandboxed
from finetune.token_count import longest_row
from finetune.train import Result, Scoring, TrainingCancelled, TrainingError, TrainingSpec, load_result
from finetune.training_network import JobNetwork

LOG_TAIL_BYTES = 65536  # of a failed trainer's log, read for its last line
RANK_RESTARTS = 3  # times torchrun starts a sharded job's ranks again after one died
# Each start of the ranks gets a store of its own (its first rank's), not the rendezvous store kept
# across starts: that one keeps the addresses the dead ranks published, and torchrun's agents count
# their starts apart (an agent whose ranks were stopped for another host's failure does not count
# it), so keying the shared store by start left the hosts waiting on different keys.
FRESH_STORE = ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"]
BEAT_S = 5.0  # the trainer's beats passed on (to the queue's progress stamp) at most this often

log = logging.getLogger("appliance.finetune")
Strategy = Literal["single", "ddp", "fsdp"]


@dataclass(frozen=True)
class Outcome:
    result: Result
    record: AdapterRecord
    failures: list[str]  # why it failed the gate; empty: passed

    @property
    def passed(self) -> bool:
        return not self.failures


def run_job(directory: Path, *, name: str, data: str, base: str, hp: Hyperparameters, settings: Settings,
            home: Home, eval_sets: dict[str, list[dict[str, Any]]] | None = None,
            on_progress: Callable[[Progress], None] = lambda p: None,
            on_child: Callable[[int], None] = lambda pid: None, on_beat: Callable[[], None] = lambda: None) -> Outcome:
    """Train in `directory` (resuming if it holds checkpoints), gate, register. `on_beat`: the
    trainer worked (a step, an evaluation batch) since the last beat, at most every BEAT_S."""
    model = checkpoint(base, home, settings, what="--base")
    store = artifact_store(settings.artifacts, home)
    digest, splits = job_data(home, store, data, hp)
    directory.mkdir(parents=True, exist_ok=True)
    seq_len = job_seq_len(model.resolve(), hp, splits)
    processes, strategy, fit = size_job(model.resolve(), hp, settings.finetune, seq_len=seq_len)
    inputs = [directory / "train.jsonl", directory / "eval.jsonl", directory / "job.json", directory / LAUNCH_FILE]
    for split, content in splits.items():
        (directory / f"{split}.jsonl").write_bytes(content)
    sets, shipped = evalsets.with_shipped_regression(eval_sets or {}, settings.finetune.regression_set,
                                                     model.resolve())
    if not shipped and "regression" not in sets and settings.finetune.regression_set == "shipped":
        log.warning("%s has no chat template: the shipped regression set is not asked of it", base)
    spec = TrainingSpec(base=model.resolve(), hyperparameters=hp, eval_sets=sets,
                        scoring=Scoring(seeds=settings.finetune.gate_seeds,
                                        temperature=settings.finetune.gate_temperature), strategy=strategy,
                        gradient_checkpointing=fit.checkpointing)
    (directory / "job.json").write_text(spec.model_dump_json())
    (directory / LAUNCH_FILE).write_text(Launch(strategy=strategy, processes=processes, seq_len=seq_len,
                                                estimated_process_bytes=fit.process_bytes).model_dump_json())
    forget_ranks(directory)
    (directory / PROGRESS_FILE).unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # one the trainer made a directory is never a beat (_stamp)
        (directory / HEARTBEAT_FILE).unlink(missing_ok=True)
    if settings.finetune.sandbox != "none":
        prepare(directory, inputs, [model.resolve()])
    limit_s = settings.finetune.max_job_hours * 3600
    if hp.hosts:
        workers = over_hosts.worker_hosts(home, settings, hp.hosts)
        with over_hosts.parts_published(home, settings, directory, spec, processes, workers) as net:
            trainer = multihost_trainer_command(directory, processes, net)
            train_in_child(directory, sandboxed(trainer, settings.finetune, workdir=directory, inputs=inputs,
                                                 readable=[model.resolve()], network=net.namespace),
                            on_progress, on_child, on_beat, limit_s=limit_s,
                            watch=lambda: over_hosts.failed_part(home, workers, directory))
    else:
        trainer = _trainer_command(directory, processes, strategy, cpu=not visible_gpus())
        train_in_child(directory, sandboxed(trainer, settings.finetune, workdir=directory, inputs=inputs,
                                             readable=[model.resolve()]), on_progress, on_child, on_beat,
                        limit_s=limit_s)
    result = load_result(directory)
    scores = checked_scores(result, sets, spec.scoring.seeds, shipped)
    failures = gate_failures(result, scores, settings.finetune)
    record_registering(directory, result, on_progress)
    record = adapters.register(
        home, store, result.adapter_dir, name=name, base_model=base,
        base_config_sha256=config_sha256(json.loads((model / "config.json").read_text())),
        dataset=data, dataset_sha256=digest, hyperparameters=hp,
        metrics=AdapterMetrics(
            base_eval_loss=result.base_eval_loss, adapter_eval_loss=result.adapter_eval_loss,
            improvement=result.improvement, steps=result.steps, train_tokens=result.train_tokens,
            seconds=result.seconds, resumed_from=result.resumed_from,
            eval_sets=scores,
            processes=result.processes, gate_failures=failures),
        state=AdapterState.FAILED_GATE if failures else AdapterState.REGISTERED)
    return Outcome(result=result, record=record, failures=failures)


def record_registering(directory: Path, result: Result, on_progress: Callable[[Progress], None]) -> None:
    """Say in the job's progress report that it registers its adapter, from the trainer's last report
    (or, if it left none, its result). The trainer has ended; a report that cannot be written is
    logged, never a failed job."""
    last = read_progress(directory) or Progress(step=result.steps, max_steps=result.steps, loss=None,
                                                tokens_per_s=0.0, eta_s=None)
    progress = last.model_copy(update={"phase": Phase.REGISTERING, "eta_s": None})
    try:
        write_progress(directory, progress)
    except OSError as exc:
        log.warning("%s: the registering phase is not in its progress report: %s", directory, exc)
    on_progress(progress)


def check_method(data: str, train: bytes, hp: Hyperparameters) -> None:
    """DPO trains on preference rows, SFT on chat and text rows: say so before anything starts."""
    if hp.method == "grpo":
        raise TrainingError("GRPO trains online from execution feedback, not on a dataset",
                            hint="`appliance rl run --method grpo`")
    first = json.loads(train.split(b"\n", 1)[0] or b"{}")
    preference = kind(first) == "preference rows"
    if preference != (hp.method == "dpo"):
        raise TrainingError(f"dataset {data!r} holds {kind(first)}: train on it with "
                            f"--method {'dpo' if preference else 'sft'}, not {hp.method}")


def checked_scores(result: Result, sets: dict[str, list[dict[str, Any]]], seeds: int,
                   shipped: bool) -> dict[str, Scores]:
    """The scores the trainer reported, as asked of it: every set it was given and no other, one
    fraction a seed for the base and the adapter. The trainer runs sandboxed and is not trusted:
    anything else fails the job (TrainingError), never the gate's judgement or the registry."""
    if set(result.eval_sets) != set(sets):
        raise TrainingError(f"the trainer scored the sets {sorted(result.eval_sets)}, not {sorted(sets)} as asked")
    scores = {}
    for set_kind, per_seed in result.eval_sets.items():
        try:
            if not isinstance(per_seed, dict) or set(per_seed) != {"base", "adapter"} or not all(
                    isinstance(found, list) and len(found) == seeds for found in per_seed.values()):
                raise ValueError(f"not {seeds} scores for the base and for the adapter")
            scores[set_kind] = Scores.over_seeds(per_seed["base"], per_seed["adapter"],
                                                 shipped=shipped and set_kind == "regression")
        except (ValueError, TypeError) as exc:
            raise TrainingError(f"the trainer's scores of the {set_kind} set are not as asked: {exc}") from exc
    return scores


def gate_failures(result: Result, scores: dict[str, Scores], gate: FinetuneSettings) -> list[str]:
    """Why the adapter fails the evaluation gate (thresholds in settings, on each set's mean score
    over its seeds); empty: it passes."""
    failures = []
    if not (math.isfinite(result.base_eval_loss) and math.isfinite(result.adapter_eval_loss)):
        failures.append(f"held-out loss {result.adapter_eval_loss} vs base {result.base_eval_loss}: not a number "
                        "(training diverged)")
    elif result.improvement <= gate.gate_min_improvement:
        failures.append(f"held-out loss {result.adapter_eval_loss:.4f} vs base {result.base_eval_loss:.4f}: "
                        f"needs to be more than {gate.gate_min_improvement:.0%} lower")
    scenarios = scores.get("scenarios")
    if scenarios and (scenarios.adapter < gate.gate_min_scenario_score or scenarios.adapter < scenarios.base):
        failures.append(f"scenario score {scenarios.adapter:.0%}{scenarios.spread_note()} (base {scenarios.base:.0%}): "
                        f"needs at least "
                        f"{gate.gate_min_scenario_score:.0%} and no less than the base")
    regression = scores.get("regression")
    if regression and regression.adapter < regression.base - gate.gate_max_regression_drop:
        noisy = max(regression.adapter_spread, regression.base_spread) > gate.gate_max_regression_drop
        failures.append(f"regression score {regression.adapter:.0%}{regression.spread_note()} vs base "
                        f"{regression.base:.0%}{' (the shipped set)' if regression.shipped else ''}: may drop by "
                        f"{gate.gate_max_regression_drop:.0%} at most"
                        + ("; the spread over seeds is wider than that: add items or seeds" if noisy else ""))
    return failures


def visible_gpus() -> int:
    """NVIDIA GPUs this process may use (CUDA_VISIBLE_DEVICES, else the driver's device files)."""
    chosen = os.environ.get("CUDA_VISIBLE_DEVICES")
    if chosen is not None:
        return len([d for d in chosen.split(",") if d.strip()])
    return len([p for p in Path("/dev").glob("nvidia*") if p.name[len("nvidia"):].isdigit()])


def choose_strategy(setting: str, processes: int, hp: Hyperparameters, *, hosts: int = 1) -> Strategy:
    """How the job's processes train (finetune.strategy), or why they cannot, before anything loads;
    over several hosts only the sharded trainer runs (each host's processes are ranks of it)."""
    if hosts > 1:
        if setting in ("single", "ddp") or hp.method != "sft":
            what = f"finetune.strategy = \"{setting}\"" if setting in ("single", "ddp") else hp.method.upper()
            raise TrainingError(f"a job over several hosts trains sharded (fsdp, SFT with LoRA or QLoRA), not {what}",
                                hint="finetune.strategy = \"auto\" or \"fsdp\", --method sft")
        return "fsdp"
    if setting == "single" and processes > 1:
        raise TrainingError(f"finetune.strategy = \"single\" trains in one process, not {processes}",
                            hint="--processes 1, or finetune.strategy = \"fsdp\" or \"ddp\"")
    if setting == "single" or (setting in ("auto", "ddp") and processes == 1):
        return "single"
    if setting == "ddp" or (setting == "auto" and hp.method != "sft"):
        return "ddp"  # the sharded trainer runs SFT only: DPO on several processes is DDP's
    if hp.method != "sft":
        raise TrainingError(f"finetune.strategy = \"fsdp\" trains SFT only, not {hp.method}",
                            hint="finetune.strategy = \"ddp\" (or \"auto\") for DPO on several processes")
    return "fsdp"


def job_data(home: Home, store: ArtifactStore, data: str, hp: Hyperparameters) -> tuple[str, dict[str, bytes]]:
    """The dataset's digest and its train and eval splits, checked against it and the method."""
    registry = load_registry(home)
    if data not in registry:
        raise TrainingError(f"no dataset named {data!r}", hint=f"datasets: {sorted(registry) or 'none'}")
    digest = registry[data]
    splits = {split: store.get(f"{PREFIX}{digest}/{split}.jsonl") for split in ("train", "eval")}
    check_dataset(data, digest, splits["train"], splits["eval"])
    check_method(data, splits["train"], hp)
    return digest, splits


def job_seq_len(base: Path, hp: Hyperparameters, splits: dict[str, bytes]) -> int:
    """Tokens of the widest batch the job trains or evaluates: its longest row, cut at --max-length."""
    return min(hp.max_length, longest_row(base, splits.values()))


def size_job(base: Path, hp: Hyperparameters, settings: FinetuneSettings, *,
             seq_len: int) -> tuple[int, Strategy, JobFit]:
    """How many processes train the job on this host, how (choose_strategy), and the training
    planner's estimate of one of them for rows of `seq_len` tokens (the data's longest, at most
    --max-length: batches are padded to their longest row); TrainingError naming the figure that
    does not fit, before anything loads. Gradient checkpointing is on only where the job does not
    fit without it (on a GPU it halved the throughput where memory was plentiful). DPO feeds each
    row's chosen and rejected answers together: twice the rows."""
    gpus = visible_gpus()
    processes = hp.processes or settings.processes or gpus or 1
    strategy = choose_strategy(settings.strategy, processes, hp, hosts=1 + len(hp.hosts))
    limit = None if settings.sandbox == "none" else sandbox_memory_bytes(settings)
    rows = hp.batch_size * (2 if hp.method == "dpo" else 1)
    fit = fit_job(JobShape(base=base, qlora=hp.qlora, rank=hp.rank, seq_len=seq_len, batch=rows,
                           processes=processes, sharded=strategy == "fsdp", process_limit_bytes=limit,
                           hosts=1 + len(hp.hosts)))
    if not fit.fits:
        where = f"{processes} process{'es' if processes > 1 else ''} ({strategy})" + (
            f" on each of {1 + len(hp.hosts)} hosts" if hp.hosts else "")
        raise TrainingError(f"the job does not fit this host's {where}: {fit.reason}",
                            hint="more processes (--processes N; finetune.strategy \"fsdp\" or \"auto\" shards the "
                                 "base over them), a smaller --max-length or --batch-size, --qlora, or a larger "
                                 "finetune.sandbox_memory_gib; `appliance plan --train` sizes a job")
    log.info("job sized: %.2f GiB a process of %.2f GiB, gradient checkpointing %s", fit.process_bytes / 2**30,
             fit.budget_bytes / 2**30, "on" if fit.checkpointing else "off")
    return processes, strategy, fit


def forget_ranks(directory: Path) -> None:
    """The ranks' memory reports of an earlier start of the job: each start reports its own."""
    ranks = directory / RANKS_DIR
    with contextlib.suppress(OSError):
        if ranks.is_symlink() or not ranks.is_dir():
            ranks.unlink()
    shutil.rmtree(ranks, ignore_errors=True)


def _trainer_command(directory: Path, processes: int, strategy: Strategy, *, cpu: bool) -> list[str]:
    """The training child: one process, or torchrun with a process per rank, which meet on the
    sandbox's own loopback device. The sharded trainer always runs under torchrun (one rank too),
    which starts every rank again, up to RANK_RESTARTS times, when one dies: they resume from the
    last whole checkpoint."""
    trainer = [sys.executable, "-P", "-m", "finetune.job", str(directory)]
    if strategy == "single":
        return trainer
    torchrun = [sys.executable, "-P", "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
    job = ["-m", "finetune.job", str(directory)]
    if strategy == "ddp":
        return [*torchrun, *job]
    # glibc keeps the freed buffers of each layer's all-gather for later; served by mmap they go
    # back to the system, and a rank's peak resident memory stayed ~350 MB lower on the demo model.
    malloc = [f"MALLOC_MMAP_THRESHOLD_={CPU_MMAP_THRESHOLD}"] if cpu else []
    return ["/usr/bin/env", *malloc, *FRESH_STORE, *torchrun, f"--max-restarts={RANK_RESTARTS}", *job]


def multihost_trainer_command(directory: Path, processes: int, net: JobNetwork) -> list[str]:
    """This host's torchrun agent of a job over several hosts, in the job's network: `processes`
    ranks, meeting the other hosts' agents at the head's ranks' address (the head's agent keeps the
    rendezvous store), gloo on the job's link; every host's ranks start again from the last
    checkpoint whole on all hosts when one dies, up to RANK_RESTARTS times."""
    return ["/usr/bin/env", f"GLOO_SOCKET_IFNAME={net.rank_link}", f"NCCL_SOCKET_IFNAME={net.rank_link}",
            f"MALLOC_MMAP_THRESHOLD_={CPU_MMAP_THRESHOLD}", *FRESH_STORE,
            "LOGLEVEL=INFO",  # torchrun says each rendezvous
            sys.executable, "-P", "-m", "torch.distributed.run", f"--nnodes={len(net.hosts)}",
            f"--nproc-per-node={processes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={net.rendezvous}",
            f"--rdzv-id=job-{net.job}", f"--rdzv-conf=is_host={int(net.node == 0)}",
            f"--local-addr={net.ranks_address(net.node)}", f"--max-restarts={RANK_RESTARTS}",
            "-m", "finetune.job", str(directory)]


def train_in_child(directory: Path, command: list[str], on_progress: Callable[[Progress], None],
                   on_child: Callable[[int], None], on_beat: Callable[[], None], *, limit_s: float,
                   log: Path | None = None, cancel: Path | None = None,
                   watch: Callable[[], None] = lambda: None) -> None:
    """Run the trainer in a process group of its own, reporting its progress; a cancel request
    (`cancel`, by default the job directory's cancel file), its running past `limit_s`, `watch`
    raising TrainingError (another host's part of the job failed) or our own end ends the whole
    group (its checkpoints stay). Its output goes to `log` (by default the job
    directory's train.log, which the trainer could have replaced: opened only as a regular file,
    never through a link)."""
    log = log or directory / "train.log"
    cancel = cancel or directory / CANCEL_FILE
    with open_log(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT) as output:
        child = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, cwd=directory,
                                 start_new_session=True,
                                 env={**os.environ, **TRAINER_ENVIRONMENT})
        on_child(child.pid)
        seen, beat_seen, beat_at = None, None, -math.inf
        deadline = time.monotonic() + limit_s
        try:
            while child.poll() is None and not cancel.exists():
                if time.monotonic() > deadline:
                    raise TrainingError(f"training ran past finetune.max_job_hours ({limit_s / 3600:g} h) and "
                                        "was ended; its checkpoints are kept", hint=f"its log: {log}")
                seen = _report(directory, seen, on_progress)
                watch()
                if time.monotonic() - beat_at >= BEAT_S and (stamp := beat_time(directory)) not in (None, beat_seen):
                    beat_seen, beat_at = stamp, time.monotonic()
                    on_beat()
                time.sleep(0.5)
        finally:
            if child.poll() is None:
                end_group(child.pid)
                child.wait()
    _report(directory, seen, on_progress)
    if cancel.exists():
        raise TrainingCancelled("training stopped as asked; its checkpoints are kept")
    if child.returncode != 0:
        with open_log(log, os.O_RDONLY) as found:
            found.seek(max(0, os.fstat(found.fileno()).st_size - LOG_TAIL_BYTES))
            tail = found.read().decode(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
        if "bwrap" in tail[0] or "setpriv" in tail[0]:
            tail[0] += " (the training sandbox could not start: see finetune.sandbox)"
        raise TrainingError(f"training failed (exit {child.returncode}): {tail[0]}", hint=f"full log: {log}")


def open_log(path: Path, flags: int) -> BinaryIO:
    """A trainer's log, opened only as a regular file (never through a link, nor a pipe waited on)."""
    try:
        handle = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    except OSError as exc:
        raise TrainingError(f"the trainer's log {path} cannot be opened as a plain file: {exc}") from exc
    if not stat.S_ISREG(os.fstat(handle).st_mode):
        os.close(handle)
        raise TrainingError(f"the trainer's log {path} is not a regular file; refused")
    return os.fdopen(handle, "ab" if flags & os.O_WRONLY else "rb")


def end_group(pid: int) -> None:
    """End a trainer's process group (torchrun's processes included), if it is still there."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def end_stale_trainer(pgid: int, directory: Path) -> None:
    """End what is left of a trainer that a dead worker started: its process group, but only while
    a member still runs in the job's directory (after a reboot the number may be another's)."""
    for member in group_members(pgid):
        try:
            if Path(member.cwd()) == directory.resolve():  # the kernel reports the resolved path
                end_group(pgid)
                return
        except psutil.Error:
            continue


def _report(directory: Path, seen: float | None, on_progress: Callable[[Progress], None]) -> float | None:
    stamp = _stamp(directory / PROGRESS_FILE)
    if stamp is None:
        return seen
    if stamp != seen and (progress := read_progress(directory)) is not None:
        on_progress(progress)
    return stamp


def _stamp(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return None


def beat_time(directory: Path) -> float | None:
    """When the trainer last beat: its heartbeat file's time, if it is a plain file (the trainer
    writes the job's directory: a link or anything else it put there is no beat, never an error)."""
    try:
        found = os.lstat(directory / HEARTBEAT_FILE)
    except OSError:
        return None
    return found.st_mtime if stat.S_ISREG(found.st_mode) else None
