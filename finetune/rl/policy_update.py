"""`python -m finetune.rl.policy_update SPEC`: one GRPO update of a policy (finetune.rl.policy), in
the training sandbox (no network; only the spec's `output` directory writable).

The spec (UpdateSpec, read-only here) says what to learn from: each task's prompt, the group of
answers the policy gave to it and their rewards (scored in the execution sandbox before). TRL's
GRPOTrainer makes the update (group-relative advantages, a KL term to the base model, LoRA through
PEFT): its rollout function hands it the group's answers instead of generating, and its reward
function reads their rewards. It resumes from `resume` (the step before's trainer state, read-only:
the adapter, the optimiser's state, the step count), leaves OUTPUT/checkpoints/checkpoint-(STEP+1)
and, last, OUTPUT/result.json. Exit status: 0 updated, 1 failed (the reason on stderr)."""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from collections import deque
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from appliance.durable import replace_file
from appliance.jobs import HEARTBEAT_FILE
from finetune.job import die_with_parent

CHECKPOINTS = "checkpoints"
RESULT = "result.json"
# What a later update resumes from (Trainer's checkpoint, less what it does not read back).
RESUME_FILES = ("adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "scheduler.pt",
                "trainer_state.json", "rng_state.pth")


class Group(BaseModel):
    """One task's prompt and the answers the policy gave to it, each with its reward."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    messages: list[dict[str, str]] = Field(min_length=1)
    answers: list[str] = Field(min_length=2)
    rewards: list[float]
    ended: list[bool] = Field(description="Whether each answer ended before max_tokens (it gets the end token).")

    @model_validator(mode="after")
    def _one_each(self) -> Group:
        if not len(self.answers) == len(self.rewards) == len(self.ended):
            raise ValueError("one reward and one ending for each answer")
        return self


class UpdateSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    base: Path
    resume: Path | None = Field(description="The trainer state after `step` updates (None for step 0).")
    output: Path = Field(description="This update's directory: the only one it writes.")
    step: int = Field(ge=0)
    beta: float = Field(gt=0)
    learning_rate: float = Field(gt=0)
    lora_rank: int = Field(ge=1)
    max_answer_tokens: int = Field(ge=1)
    seed: int = 0
    groups: list[Group] = Field(min_length=1)

    @model_validator(mode="after")
    def _same_size(self) -> UpdateSpec:
        if len({len(group.answers) for group in self.groups}) != 1:
            raise ValueError("every group holds as many answers")
        if (self.resume is None) != (self.step == 0):
            raise ValueError("an update after the first resumes the trainer state of the one before")
        return self


class UpdateResult(BaseModel):
    """What the update reports (read back by the rl-worker, which does not trust it: checked, and
    only shown; the rewards' figures are the worker's own)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    step: int = Field(ge=1, le=1_000_000, description="The trainer's step count after this update.")
    loss: float = Field(ge=-1e6, le=1e6)
    kl: float = Field(ge=0, le=1e6)
    train_tokens: int = Field(ge=0, le=10**12, description="Prompt and answer tokens the update saw, no padding.")
    seconds: float = Field(ge=0, le=10**7)


def update(spec: UpdateSpec) -> UpdateResult:
    import torch  # heavy: only in the trainer
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl.trainer.grpo_config import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(spec.base)
    end = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    size = len(spec.groups[0].answers)
    keys = [f"group-{i}" for i in range(len(spec.groups))]  # the rows the trainer repeats `size` times each
    prompts = {key: list(tokenizer.apply_chat_template(group.messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))
               for key, group in zip(keys, spec.groups, strict=True)}
    waiting = {key: deque(zip(group.answers, group.rewards, group.ended, strict=True))
               for key, group in zip(keys, spec.groups, strict=True)}
    tokens = 0

    def rollout(asked: list[str], trainer: Any) -> dict[str, Any]:
        nonlocal tokens
        out: dict[str, Any] = {"prompt_ids": [], "completion_ids": [], "logprobs": None, "reward": []}
        for key in asked:
            answer, reward, ended = waiting[key].popleft()
            ids = tokenizer(answer, add_special_tokens=False)["input_ids"][:spec.max_answer_tokens]
            out["prompt_ids"].append(prompts[key])
            out["completion_ids"].append(ids + end if ended else ids)
            out["reward"].append(reward)
            tokens += len(prompts[key]) + len(out["completion_ids"][-1])
        return out

    def reward(completions: list[Any], reward: list[float | None], **_: Any) -> list[float | None]:
        return reward

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental
    args = GRPOConfig(
        output_dir=str(spec.output / CHECKPOINTS), num_generations=size, per_device_train_batch_size=len(keys) * size,
        gradient_accumulation_steps=1, max_steps=spec.step + 1, beta=spec.beta, learning_rate=spec.learning_rate,
        lr_scheduler_type="constant", warmup_steps=0, logging_steps=1, report_to=[], save_strategy="steps",
        save_steps=1, save_total_limit=2, use_cpu=not torch.cuda.is_available(), bf16=False,
        max_completion_length=spec.max_answer_tokens + 1, shuffle_dataset=False, disable_tqdm=True, seed=spec.seed)
    trainer = GRPOTrainer(
        model=str(spec.base), reward_funcs=reward, args=args, processing_class=tokenizer, rollout_func=rollout,
        train_dataset=Dataset.from_list([{"prompt": key} for key in keys]),
        peft_config=LoraConfig(r=spec.lora_rank, lora_alpha=2 * spec.lora_rank, lora_dropout=0.0,
                               target_modules="all-linear", task_type="CAUSAL_LM"))
    trainer.train(resume_from_checkpoint=str(spec.resume) if spec.resume else None)
    figures = next(entry for entry in reversed(trainer.state.log_history)
                   if entry.get("step") == spec.step + 1 and "loss" in entry)
    return UpdateResult(step=spec.step + 1, loss=figures["loss"], kl=max(0.0, figures.get("kl", 0.0)),
                        train_tokens=tokens, seconds=round(time.monotonic() - started, 3))


def beat(directory: Path, every_s: float = 10.0) -> None:
    """Touch DIR's heartbeat while the update runs (its one step may take long on a large model):
    the worker passes the beats on to the run's progress stamp, so the watchdog does not take the
    update for a stall; a trainer that hangs is still ended at finetune.max_job_hours."""
    def touch() -> None:
        while True:
            (directory / HEARTBEAT_FILE).touch()
            time.sleep(every_s)
    threading.Thread(target=touch, daemon=True, name="beat").start()


def main(spec_file: Path) -> int:
    die_with_parent()
    # GRPOTrainer looks at the vLLM it finds (the engine's, newer than it knows), which it does not use here.
    warnings.filterwarnings("ignore", "TRL currently supports vLLM versions")
    try:
        spec = UpdateSpec.model_validate_json(spec_file.read_bytes())
        beat(spec.output)
        result = update(spec)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    replace_file(spec.output / RESULT, result.model_dump_json().encode())
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
