"""Online GRPO: a run with RunSpec.grpo trains a LoRA policy step by step.

Each step takes the next `tasks_per_step` training tasks and asks the policy's current version for
a group of `samples` answers to each, through the gateway under the run's service identity (so
every answer is authenticated and audited); the answers run in the execution sandbox and earn
their rewards (finetune.rl.loop: tests passed, efficiency, length). The update runs in the training
sandbox (finetune.rl.policy_update: TRL's GRPOTrainer, group-relative advantages, a KL term to the
base). The version it trains is registered and served under the policy's name to the `trainer`
role (the RL service identity holds it; users do not see a policy in training): the gateway loads
it into the engine on its first request, and the next step's answers come from it, which each
attempt's engine name proves.

Everything a step leaves is durable before the next starts: answers and verdicts in the run's
store, the trainer's checkpoint (adapter, optimiser state, step count), the version in the
registry, then the step's figures. A run killed anywhere resumes at its first unfinished step,
from the version the last finished step trained; an update already done is not done again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import stat
import sys
import tempfile
import time
from pathlib import Path

from appliance import adapters
from appliance.adapters import AdapterMetrics, AdapterState
from appliance.artifacts import artifact_store
from appliance.changes import Change, Target, announce
from appliance.durable import read_small_file
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
from finetune.rl.policy_update import (
    Group,
    UpdateResult,
    UpdateSpec,
    checkpoint_dir,
    result_file,
    update_file,
)
from finetune.runner import train_in_child
from finetune.sandbox import prepare, sandboxed

log = logging.getLogger("appliance.rl-policy")
POLICY_DIR = "policy"  # in the run's directory: the update trainer's own (the only place it may write)
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
POLICY_ROLES = [Role.TRAINER]
MAX_RESULT_BYTES = 1 << 16


def step_tasks(tasks: list[Task], step: int, per_step: int) -> list[Task]:
    """The tasks of a step: the training tasks in turn, `per_step` at a time (all of them, if fewer)."""
    take = min(per_step, len(tasks))
    return [tasks[(step * take + i) % len(tasks)] for i in range(take)]


def lora_pool(loop: Loop) -> str:
    """The pool serving the run's base model with adapters on (the policy's versions are served there)."""
    for pool in loop.settings.pools:
        if served_name(pool, loop.home) == loop.spec.base and pool.enable_lora:
            return pool.name
    raise Invalid(f"no pool serves {loop.spec.base!r} with adapters: a GRPO run serves its policy's versions",
                  hint="set pools.<name>.enable_lora = true for the pool serving it, and restart it")


def read_result(directory: Path, step: int) -> UpdateResult | None:
    """A step's update result, once the update and its checkpoint are complete (None before);
    checked, as the trainer runs sandboxed and is not trusted."""
    path = result_file(directory, step)
    if not path.exists() and not path.is_symlink():
        return None
    if (found := read_small_file(path, MAX_RESULT_BYTES)) is None:
        raise ApplianceError(f"step {step}: the update's result {path} is not a plain file of at most "
                             f"{MAX_RESULT_BYTES} bytes")
    try:
        result = UpdateResult.model_validate_json(found[0])
    except ValueError as exc:
        raise ApplianceError(f"step {step}: the update's result is not as asked: {exc}") from exc
    if result.step != step + 1 or not all((checkpoint_dir(directory, step + 1) / name).is_file()
                                          for name in ADAPTER_FILES):
        raise ApplianceError(f"step {step}: the update's result or checkpoint is not step {step + 1}'s")
    return result


def copy_plain_file(source: Path, target: Path) -> None:
    """Copy a file the sandboxed trainer made, only if it is a regular file: never a link followed
    (it would show the worker's view of the host), nor a pipe waited on."""
    try:
        handle = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise ApplianceError(f"{source}: the trained adapter's file cannot be read as a plain file: {exc}") from exc
    with open(handle, "rb") as found:
        if not stat.S_ISREG(os.fstat(handle).st_mode):
            raise ApplianceError(f"{source}: the trained adapter's file is not a regular file; refused")
        with open(target, "xb") as copy:
            shutil.copyfileobj(found, copy)


class PolicyTraining:
    def __init__(self, loop: Loop) -> None:
        if loop.spec.grpo is None:
            raise Invalid(f"run {loop.run.id} is not a GRPO run")
        self.loop, self.grpo = loop, loop.spec.grpo
        self.directory = loop.directory / POLICY_DIR
        self.directory.mkdir(exist_ok=True)
        self.base = checkpoint(loop.spec.base, loop.home, loop.settings, what="--base").resolve()
        self.pool = lora_pool(loop)
        self.tag = f"rl-run-{loop.run.id}"  # the registry's `dataset` of the versions this run trains

    def train(self) -> str:
        """Every step to the end (or to a cancel request: RunCancelled); the outcome in one line."""
        done = self.loop.store.policy_steps()
        if not done:
            self._check_name_is_ours()
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
        group = [attempts[first.key] for first in firsts]
        if strangers := sorted({a.model for a in group if a.model and a.model != answering}):
            raise Conflict(f"step {step}: answers came from {strangers}, not {answering}: what "
                           f"{self.grpo.policy!r} serves was changed while the run trained it")
        result = self._update(step, firsts, group)
        version = self._serve(step, result)
        figures = PolicyStep(
            step=step, version=version, generated_by=answering, answers=len(group),
            reward_mean=result.reward_mean, reward_spread=result.reward_spread,
            pass_rate=sum(a.status == "passed" for a in group) / len(group), kl=result.kl, loss=result.loss,
            train_tokens=result.train_tokens, sample_s=round(sample_s, 3),
            generate_s=round(sum(a.generate_s for a in group), 3), execute_s=round(sum(a.execute_s for a in group), 3),
            update_s=result.seconds)
        self.loop.store.save_policy_step(figures)
        log.info("run %d step %d: v%d, reward %.3f +/- %.3f, KL %.4f", self.loop.run.id, step, version,
                 figures.reward_mean, figures.reward_spread, figures.kl)
        return figures

    def _update(self, step: int, firsts: list[Step], group: list[Attempt]) -> UpdateResult:
        """The update of this step, in the training sandbox; one already done (the run was killed
        before it recorded the step) is read back, not done again."""
        if (found := read_result(self.directory, step)) is not None:
            return found
        shutil.rmtree(checkpoint_dir(self.directory, step + 1), ignore_errors=True)  # a partial one
        size = self.loop.spec.samples
        groups = [Group(messages=firsts[i].messages, answers=[a.completion for a in group[i:i + size]],
                        rewards=[a.reward for a in group[i:i + size]],
                        ended=[a.completion_tokens is not None and a.completion_tokens < self.loop.spec.max_tokens
                               for a in group[i:i + size]])
                  for i in range(0, len(group), size)]
        spec = UpdateSpec(base=self.base, step=step, beta=self.grpo.beta, learning_rate=self.grpo.learning_rate,
                          lora_rank=self.grpo.lora_rank, max_answer_tokens=self.loop.spec.max_tokens,
                          seed=self.loop.spec.seed, groups=groups)
        inputs = [update_file(self.directory, step)]
        inputs[0].write_text(spec.model_dump_json())
        settings = self.loop.settings
        if settings.finetune.sandbox != "none":
            prepare(self.directory, inputs, self.base)
        command = [sys.executable, "-P", "-m", "finetune.rl.policy_update", str(self.directory), str(step)]
        train_in_child(self.directory, sandboxed(command, settings.finetune, workdir=self.directory, inputs=inputs,
                                                 readable=[self.base]),
                       lambda progress: None, lambda pid: None,
                       lambda: runs.progressed(self.loop.home, self.loop.run.id, os.getpid()),
                       limit_s=settings.finetune.max_job_hours * 3600)
        found = read_result(self.directory, step)
        if found is None:
            raise ApplianceError(f"step {step}: the update ended without its result", hint=f"its log: "
                                 f"{self.directory / 'train.log'}")
        return found

    def _serve(self, step: int, result: UpdateResult) -> int:
        """The step's adapter registered (once) and served under the policy's name to the trainer role."""
        loop, name = self.loop, self.grpo.policy
        ours = [r for r in adapters.load(loop.home).versions(name)
                if r.dataset == self.tag and r.metrics.steps == step + 1]
        if ours:
            version = ours[0].version
        else:
            # Out of the trainer's reach (its directory is the sandbox's): the weights only, the
            # optimiser's state stays in the checkpoint.
            adapter = Path(tempfile.mkdtemp(prefix=f".adapter-{step + 1}-", dir=loop.directory))
            for file in ADAPTER_FILES:
                copy_plain_file(checkpoint_dir(self.directory, step + 1) / file, adapter / file)
            record = registration.register(
                loop.home, artifact_store(loop.settings.artifacts, loop.home), adapter, name=name,
                base_model=loop.spec.base,
                base_config_sha256=config_sha256(json.loads((self.base / "config.json").read_text())),
                dataset=self.tag,
                dataset_sha256=hashlib.sha256(update_file(self.directory, step).read_bytes()).hexdigest(),
                hyperparameters=Hyperparameters(rank=self.grpo.lora_rank, alpha=2 * self.grpo.lora_rank, dropout=0.0,
                                                learning_rate=self.grpo.learning_rate, max_steps=step + 1,
                                                batch_size=len(step_tasks(loop.tasks, step, self.grpo.tasks_per_step))
                                                * loop.spec.samples,
                                                method="grpo", beta=self.grpo.beta, seed=loop.spec.seed),
                metrics=AdapterMetrics(base_eval_loss=math.nan, adapter_eval_loss=math.nan, improvement=math.nan,
                                       steps=step + 1, train_tokens=result.train_tokens, seconds=result.seconds),
                state=AdapterState.REGISTERED)
            shutil.rmtree(adapter)
            version = record.version
        with adapters.updating(loop.home) as registry:
            registry.deploy(name, version, self.pool, POLICY_ROLES)
        try:
            announce(Change("rl.policy", "allowed", 0, Target(kind="adapter", name=name, version=version),
                            f"run {loop.run.id} step {step}: {name} v{version} serves the run's next answers",
                            actor="rl-worker"))
        except ApplianceError as exc:
            log.error("run %d: policy v%d not recorded in the audit log: %s", loop.run.id, version, exc.one_line())
        return version

    def _check_name_is_ours(self) -> None:
        """A new run trains a name of its own: never one that serves (or served) something else."""
        others = [r for r in adapters.load(self.loop.home).versions(self.grpo.policy) if r.dataset != self.tag]
        if others:
            raise Invalid(f"adapter name {self.grpo.policy!r} already has versions not trained by this run",
                          hint="give the run a --policy name of its own")
