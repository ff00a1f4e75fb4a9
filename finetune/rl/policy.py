"""Online GRPO: a run with RunSpec.grpo trains a LoRA policy step by step.

Each step takes the next `tasks_per_step` training tasks and asks the policy's current version for
a group of `samples` answers to each, through the gateway under the run's service identity (so
every answer is authenticated and audited); the answers run in the execution sandbox and earn
their rewards (finetune.rl.loop: tests passed, efficiency, length). The update runs in the training
sandbox (finetune.rl.policy_update: TRL's GRPOTrainer, group-relative advantages, a KL term to the
base). The version it trains is registered and served under the policy's name to role `rl-policy`
(the RL service identity holds it; no person does unless granted): the gateway loads it into the
engine on its first request, and the next step's answers come from it, which each attempt's
engine name proves.

The trainer is not trusted. It writes only `step-N/`, a directory of its own made fresh for each
update; everything else in the policy's directory is the worker's (`update-N.json`, its log, and
`trained-K/`: what the update left, copied out as plain files of bounded size, never through a
link, with the worker's own figures). The next update reads `trained-K/` read-only.

Everything a step leaves is durable before the next starts: answers and verdicts in the run's
store, its trajectories in the artifact store, `trained-K/`, the version in the registry, then
the step's figures. A run killed anywhere resumes at its first unfinished step, from the version
the last finished step trained; an update already done is not done again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import stat
import statistics
import sys
import time
from pathlib import Path

from appliance import adapters
from appliance.adapters import AdapterMetrics, AdapterRecord, AdapterState
from appliance.artifacts import artifact_store
from appliance.changes import Change, Target, announce
from appliance.durable import replace_file
from appliance.engine_launch import serves_adapters
from appliance.errors import ApplianceError, Conflict, Invalid, Unavailable
from appliance.jobs import CANCEL_FILE, Hyperparameters
from appliance.model_refs import checkpoint, served_name
from appliance.records import config_sha256
from appliance.rl import runs
from appliance.rl.attempts import Attempt
from appliance.rl.progress import PolicyStep
from appliance.rl.tasks import Task
from appliance.roles import Role
from finetune import adapters as registration
from finetune.rl.loop import Loop, RunCancelled, Step, first_messages
from finetune.rl.policy_update import CHECKPOINTS, RESULT, RESUME_FILES, Group, UpdateResult, UpdateSpec
from finetune.runner import train_in_child
from finetune.sandbox import prepare, sandboxed

log = logging.getLogger("appliance.rl-policy")
POLICY_DIR = "policy"  # in the run's directory
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # what is registered and served
POLICY_ROLES = [Role.RL_POLICY]
SMALL_BYTES = 1 << 16  # the result and the adapter's config, at most


class UntrustedOutput(ApplianceError):
    """What the sandboxed trainer left is not what an update leaves."""


def step_tasks(tasks: list[Task], step: int, per_step: int) -> list[Task]:
    """The tasks of a step: the training tasks in turn, `per_step` at a time (all of them, if fewer)."""
    take = min(per_step, len(tasks))
    return [tasks[(step * take + i) % len(tasks)] for i in range(take)]


def lora_pool(loop: Loop) -> str:
    """The pool serving the run's base model with adapters on (the policy's versions are served there)."""
    for pool in loop.settings.pools:
        if served_name(pool, loop.home) == loop.spec.base and serves_adapters(pool, loop.settings, loop.home):
            return pool.name
    raise Invalid(f"no pool serves {loop.spec.base!r} with adapters: a GRPO run serves its policy's versions",
                  hint="set pools.<name>.enable_lora = true for the pool serving it, and restart it")


def open_beneath(top: Path, parts: tuple[str, ...], max_bytes: int) -> int:
    """A descriptor on the regular file top/parts..., every component opened without following a
    link (the trainer may have made any of them one), and the file no larger than `max_bytes`."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for part in parts[:-1]:
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = inner
        found = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    except OSError as exc:
        raise UntrustedOutput(f"{top.joinpath(*parts)}: not a plain file the update left: {exc}") from exc
    finally:
        os.close(fd)
    size = os.fstat(found)
    if not stat.S_ISREG(size.st_mode) or size.st_size > max_bytes:
        os.close(found)
        raise UntrustedOutput(f"{top.joinpath(*parts)}: not a regular file of at most {max_bytes} bytes; refused")
    return found


def read_beneath(top: Path, parts: tuple[str, ...], max_bytes: int) -> bytes:
    with os.fdopen(open_beneath(top, parts, max_bytes), "rb") as found:
        return found.read(max_bytes + 1)


def copy_beneath(top: Path, parts: tuple[str, ...], target: Path, max_bytes: int) -> None:
    with os.fdopen(open_beneath(top, parts, max_bytes), "rb") as found:
        with os.fdopen(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "wb") as copy:
            shutil.copyfileobj(found, copy)


def checked_result(workdir: Path, step: int) -> UpdateResult:
    """The update's report, as asked: step `step + 1`'s."""
    try:
        result = UpdateResult.model_validate_json(read_beneath(workdir, (RESULT,), SMALL_BYTES))
    except ValueError as exc:
        raise UntrustedOutput(f"step {step}: the update's result is not as asked: {exc}") from exc
    if result.step != step + 1:
        raise UntrustedOutput(f"step {step}: the update reported step {result.step}, not {step + 1}")
    return result


def check_adapter_config(data: bytes, rank: int) -> None:
    """The adapter's config as the update was asked to train it (vLLM reads it as it is)."""
    try:
        config = json.loads(data)
        wanted = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}
        if not isinstance(config, dict) or any(config.get(k) != v for k, v in wanted.items()):
            raise ValueError(f"not a LoRA of rank {rank} and alpha {2 * rank}")
        if config.get("modules_to_save"):
            raise ValueError("it saves whole modules besides the LoRA")
    except ValueError as exc:
        raise UntrustedOutput(f"the trained adapter's config is not as asked: {exc}") from exc


def ended(answer: Attempt, max_tokens: int) -> bool:
    """Whether the answer ended before max_tokens (the engine stopped it: it gets the end token)."""
    return answer.completion_tokens is not None and answer.completion_tokens < max_tokens


class PolicyTraining:
    def __init__(self, loop: Loop) -> None:
        if loop.spec.grpo is None:
            raise Invalid(f"run {loop.run.id} is not a GRPO run")
        self.loop, self.grpo = loop, loop.spec.grpo
        runs.check_policy_name(loop.spec, loop.settings, loop.home)
        self.directory = loop.directory / POLICY_DIR  # the worker's; the trainer writes only step-N/ in it
        self.directory.mkdir(mode=0o700, exist_ok=True)
        self.base = checkpoint(loop.spec.base, loop.home, loop.settings, what="--base").resolve()
        self.pool = lora_pool(loop)
        self.tag = f"rl-run-{loop.run.id}"  # the registry's `dataset` of the versions this run trains
        # An update's files are never larger than this: four times the base model's weights.
        self.max_bytes = 4 * sum(p.stat().st_size for p in self.base.iterdir() if p.is_file()) + SMALL_BYTES

    def trained(self, steps: int) -> Path:
        """The worker's copy of what the update to `steps` steps left."""
        return self.directory / f"trained-{steps}"

    def train(self) -> str:
        """Every step to the end (or to a cancel request: RunCancelled); the outcome in one line."""
        done = self.loop.store.policy_steps()
        self._check_name(self._our_versions())
        if self.loop.run.attempts > 1:
            self.loop.resumed_from = (f"step {len(done)} (policy v{done[-1].version})" if done
                                      else "step 0 (the base model)")
            log.info("run %d resumes at %s", self.loop.run.id, self.loop.resumed_from)
        try:
            for step in range(len(done), self.grpo.steps):
                if (self.loop.directory / CANCEL_FILE).exists():
                    raise RunCancelled("run stopped as asked; its steps so far are kept")
                done.append(self.step(step, done[-1] if done else None))
                self.loop.report()
        except Unavailable:
            raise  # the worker waits and resumes the run: nothing final to write yet
        except Exception:
            self.loop.keep_trajectories()  # a cancelled or failed run does not resume: what it did is kept
            raise
        manifest = self.loop.writer.finish()
        last = done[-1]
        return (f"{len(done)} GRPO steps: policy {self.grpo.policy} v{last.version}; last step's reward "
                f"{last.reward_mean:.3f} +/- {last.reward_spread:.3f}, pass rate {last.pass_rate:.0%}, "
                f"KL {last.kl:.4f}; trajectories {manifest}")

    def step(self, step: int, before: PolicyStep | None) -> PolicyStep:
        """One step: the group from the current version, executed; the update; the new version served."""
        asked = self.grpo.policy if before else self.loop.spec.base
        answering = adapters.engine_name(self.grpo.policy, before.version) if before else self.loop.spec.base
        firsts = [Step(task, step * self.loop.spec.samples + g, 0, first_messages(task))
                  for task in step_tasks(self.loop.tasks, step, self.grpo.tasks_per_step)
                  for g in range(self.loop.spec.samples)]
        started = time.monotonic()
        self.loop.attempt_all(firsts, asked)
        sample_s = time.monotonic() - started
        # The step's trajectories in the artifact store before the policy learns from them (a store
        # that is away: Unavailable, and the run waits and resumes here).
        self.loop.writer.flush(at_least=1)
        attempts = {a.key: a for a in self.loop.store.attempts()}
        answers = [attempts[first.key] for first in firsts]
        groups, learned = self._groups(step, firsts, answers, answering)
        result = self._update(step, groups)
        version = self._serve(step, result)
        rewards = [a.reward for a in learned]
        figures = PolicyStep(
            step=step, version=version, generated_by=answering, answers=len(learned),
            reward_mean=statistics.fmean(rewards), reward_spread=statistics.pstdev(rewards),
            pass_rate=sum(a.status == "passed" for a in learned) / len(learned), kl=result.kl,
            loss=result.loss, train_tokens=result.train_tokens, sample_s=round(sample_s, 3),
            generate_s=round(sum(a.generate_s for a in answers), 3),
            execute_s=round(sum(a.execute_s for a in answers), 3), update_s=result.seconds)
        self.loop.store.save_policy_step(figures)
        log.info("run %d step %d: v%d, reward %.3f +/- %.3f, KL %.4f", self.loop.run.id, step, version,
                 figures.reward_mean, figures.reward_spread, figures.kl)
        return figures

    def _groups(self, step: int, firsts: list[Step], answers: list[Attempt],
                answering: str) -> tuple[list[Group], list[Attempt]]:
        """Each task's answers with their rewards, and the answers they hold; a task the gateway
        refused an answer to is left out (that was no answer of the policy's), and every other
        answer must come from `answering`."""
        size = self.loop.spec.samples
        groups: list[Group] = []
        learned: list[Attempt] = []
        refused: list[str] = []
        for i in range(0, len(answers), size):
            group = answers[i:i + size]
            if strangers := sorted({a.model for a in group if a.model and a.model != answering}):
                raise Conflict(f"step {step}: answers came from {strangers}, not {answering}: what "
                               f"{self.grpo.policy!r} serves was changed while the run trained it")
            if any(not a.model for a in group):
                refused.append(f"{group[0].task}: {next(a.exit_reason for a in group if not a.model)}")
                continue
            learned += group
            groups.append(Group(messages=firsts[i].messages, answers=[a.completion for a in group],
                                rewards=[a.reward for a in group],
                                ended=[ended(a, self.loop.spec.max_tokens) for a in group]))
        if refused:
            log.warning("run %d step %d: left out (the gateway refused an answer): %s", self.loop.run.id, step,
                        "; ".join(refused))
        if not groups:
            raise Invalid(f"step {step}: the gateway refused an answer in every group: {'; '.join(refused)}")
        return groups, learned

    def _update(self, step: int, groups: list[Group]) -> UpdateResult:
        """The update of this step in the training sandbox, and what it left copied out; one
        already done (the run was killed before it recorded the step) is read back, not done again."""
        trained = self.trained(step + 1)
        if trained.is_dir():  # the worker's own, renamed into place once complete
            return UpdateResult.model_validate_json((trained / RESULT).read_bytes())
        workdir = self.directory / f"step-{step}"
        shutil.rmtree(workdir, ignore_errors=True)  # a killed update's: its trainer starts again
        workdir.mkdir(mode=0o700)  # the sandbox's user's (prepare)
        spec = UpdateSpec(base=self.base, resume=self.trained(step) if step else None, output=workdir, step=step,
                          beta=self.grpo.beta, learning_rate=self.grpo.learning_rate, lora_rank=self.grpo.lora_rank,
                          max_answer_tokens=self.loop.spec.max_tokens, seed=self.loop.spec.seed, groups=groups)
        spec_file = self.directory / f"update-{step}.json"
        replace_file(spec_file, spec.model_dump_json().encode())
        readable = [self.base, *([spec.resume] if spec.resume else [])]
        settings = self.loop.settings
        if settings.finetune.sandbox != "none":
            prepare(workdir, [spec_file], readable)
        command = [sys.executable, "-P", "-m", "finetune.rl.policy_update", str(spec_file)]
        train_in_child(workdir, sandboxed(command, settings.finetune, workdir=workdir, inputs=[spec_file],
                                          readable=readable),
                       lambda progress: None, lambda pid: None,
                       lambda: runs.progressed(self.loop.home, self.loop.run.id, os.getpid()),
                       limit_s=settings.finetune.max_job_hours * 3600,
                       log=self.directory / f"train-{step}.log", cancel=self.loop.directory / CANCEL_FILE)
        result = checked_result(workdir, step)
        self._copy_out(workdir, step, result)
        shutil.rmtree(workdir)
        return result

    def _copy_out(self, workdir: Path, step: int, result: UpdateResult) -> None:
        """What the next update resumes from and the adapter to serve, out of the trainer's reach."""
        partial = self.directory / f".trained-{step + 1}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(mode=0o700)  # the next update's sandbox is let read it (prepare)
        where = (CHECKPOINTS, f"checkpoint-{step + 1}")
        config = read_beneath(workdir, (*where, "adapter_config.json"), SMALL_BYTES)
        check_adapter_config(config, self.grpo.lora_rank)
        for name in RESUME_FILES:
            copy_beneath(workdir, (*where, name), partial / name, self.max_bytes)
        replace_file(partial / RESULT, result.model_dump_json().encode())
        partial.rename(self.trained(step + 1))

    def _files(self, steps: int) -> dict[str, str]:
        """The SHA-256 of each file the update to `steps` steps registers."""
        return {name: hashlib.sha256((self.trained(steps) / name).read_bytes()).hexdigest() for name in ADAPTER_FILES}

    def _our_versions(self) -> set[int]:
        """The versions of the policy's name this run registered: those holding its updates' files
        (a name tag alone could be another's)."""
        ours = [self._files(k) for k in range(1, self.grpo.steps + 1) if self.trained(k).is_dir()]
        return {r.version for r in adapters.load(self.loop.home).versions(self.grpo.policy)
                if r.dataset == self.tag and r.hyperparameters.method == "grpo" and r.files in ours}

    def _check_name(self, ours: set[int], registry: adapters.Registry | None = None) -> None:
        """The run trains and serves a name only while every version of it is the run's own and
        what the name serves is what the run made it serve."""
        registry = registry or adapters.load(self.loop.home)
        name = self.grpo.policy
        if others := [r.version for r in registry.versions(name) if r.version not in ours]:
            raise Conflict(f"adapter name {name!r} has versions this run did not train (v{others[0]})",
                           hint="give the run a --policy name of its own")
        alias = registry.aliases.get(name)
        if alias is not None and (alias.roles != POLICY_ROLES or alias.canary is not None):
            raise Conflict(f"what {name!r} serves was changed while the run trained it")

    def _serve(self, step: int, result: UpdateResult) -> int:
        """The step's adapter registered (once) and served under the policy's name to rl-policy."""
        loop, name, files = self.loop, self.grpo.policy, self._files(step + 1)
        ours = self._our_versions()
        found = [r.version for r in adapters.load(loop.home).versions(name) if r.version in ours and r.files == files]
        version = found[0] if found else self._register(step, result).version
        with adapters.updating(loop.home) as registry:
            self._check_name(ours | {version}, registry)
            registry.deploy(name, version, self.pool, POLICY_ROLES)
        try:
            announce(Change("rl.policy", "allowed", 0, Target(kind="adapter", name=name, version=version),
                            f"run {loop.run.id} step {step}: {name} v{version} serves the run's next answers",
                            actor="rl-worker"))
        except ApplianceError as exc:
            log.error("run %d: policy v%d not recorded in the audit log: %s", loop.run.id, version, exc.one_line())
        return version

    def _register(self, step: int, result: UpdateResult) -> AdapterRecord:
        loop = self.loop
        adapter = self.directory / f".adapter-{step + 1}"
        shutil.rmtree(adapter, ignore_errors=True)
        adapter.mkdir()
        for name in ADAPTER_FILES:
            shutil.copyfile(self.trained(step + 1) / name, adapter / name)
        record = registration.register(
            loop.home, artifact_store(loop.settings.artifacts, loop.home), adapter, name=self.grpo.policy,
            base_model=loop.spec.base,
            base_config_sha256=config_sha256(json.loads((self.base / "config.json").read_text())),
            dataset=self.tag,
            dataset_sha256=hashlib.sha256((self.directory / f"update-{step}.json").read_bytes()).hexdigest(),
            hyperparameters=Hyperparameters(rank=self.grpo.lora_rank, alpha=2 * self.grpo.lora_rank, dropout=0.0,
                                            learning_rate=self.grpo.learning_rate, max_steps=step + 1,
                                            batch_size=len(step_tasks(loop.tasks, step, self.grpo.tasks_per_step))
                                            * loop.spec.samples, method="grpo", beta=self.grpo.beta,
                                            seed=loop.spec.seed),
            metrics=AdapterMetrics(base_eval_loss=math.nan, adapter_eval_loss=math.nan, improvement=math.nan,
                                   steps=step + 1, train_tokens=result.train_tokens, seconds=result.seconds),
            state=AdapterState.REGISTERED)
        shutil.rmtree(adapter)
        return record
