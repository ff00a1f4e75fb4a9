"""LoRA / QLoRA training of an adapter on a stored dataset, with TRL's SFT trainer (or its DPO
trainer on preference rows) and PEFT, and the evaluation gate: held-out loss of the base model
against base + adapter (for DPO, its preference loss: ln 2 for the base, which prefers neither).

SFT rows reach TRL tokenized, with the labels finetune.chat_tokens gives them (a chat's last
assistant turn, every assistant turn of a chat that offers tools, all of a text), as the sharded
trainer has them; preference rows go to DPO as they are stored (prompt, chosen, rejected).
Checkpoints are written every `save_steps`, and a run started again on the same output
directory resumes from the last one.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from appliance.durable import read_small_file
from appliance.errors import ApplianceError
from appliance.jobs import Hyperparameters, Progress
from finetune import evalsets
from finetune.chat_tokens import token_rows
from finetune.phases import Phases

ANSWER_TOKENS = 48  # tokens generated at most to score an evaluation item
MAX_RESULT_BYTES = 1 << 20  # the trainer's result.json: figures, never data
SCORE_BATCH = 32  # evaluation items answered in one generate call (the shipped regression set: one)...
SCORE_TOKENS = 16_384  # ...holding at most this many prompt tokens, padded


class TrainingError(ApplianceError):
    """Training could not run or the gate refused the adapter."""


class TrainingCancelled(TrainingError):
    """Training was stopped because it was asked to (`appliance finetune cancel`)."""


class Scoring(BaseModel):
    """How the evaluation sets are answered: `seeds` times each, sampled at `temperature` with
    seeds 0..seeds-1 (one seed: greedy answers)."""

    seeds: int = Field(1, ge=1, le=20)
    temperature: float = Field(0.5, gt=0, le=2)


class TrainingSpec(BaseModel):
    """DIR/job.json: what the runner asks the sandboxed trainer (finetune.job) to train."""

    base: Path  # the checkpoint's real path (the sandbox shows that directory, not links to it)
    hyperparameters: Hyperparameters
    eval_sets: dict[str, list[dict[str, Any]]] = {}  # kind -> items (finetune.evalsets)
    scoring: Scoring = Scoring()
    strategy: Literal["single", "ddp", "fsdp"] = "single"  # fsdp: finetune.sharded; the others: train_adapter
    gradient_checkpointing: bool = False  # the runner's choice, from the job's memory budget (finetune.runner.size_job)
    node: int = Field(0, ge=0)  # this host's place in a job over several (0: the head); fsdp only


@dataclass(frozen=True)
class Result:
    adapter_dir: Path
    base_eval_loss: float
    adapter_eval_loss: float
    steps: int
    # Tokens fed to the model in training, padding excluded (prompts included: they go through the
    # model even where the loss is on completions only), by all processes, before a resume too.
    train_tokens: int
    seconds: float  # spent training in this run (evaluation and scoring excluded)
    resumed_from: str | None
    # kind -> {"base": [score per seed], "adapter": [...]} (appliance.adapters.Scores.over_seeds)
    eval_sets: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    processes: int = 1  # processes (ranks) that trained it

    @property
    def improvement(self) -> float:
        """Relative drop of held-out loss (0.1 = 10 % lower than the base)."""
        return 1 - self.adapter_eval_loss / self.base_eval_loss

    @property
    def perplexities(self) -> tuple[float, float]:
        return math.exp(self.base_eval_loss), math.exp(self.adapter_eval_loss)


def train_adapter(base: Path, train: list[dict[str, Any]], evaluation: list[dict[str, Any]], out_dir: Path,
                  hp: Hyperparameters, on_progress: Callable[[Progress], None] = lambda p: None,
                  eval_sets: dict[str, list[dict[str, Any]]] | None = None,
                  on_beat: Callable[[], None] = lambda: None, scoring: Scoring | None = None,
                  checkpointing: bool = False) -> Result | None:
    """Train, evaluate base and adapter on the held-out rows (and score both on `eval_sets`:
    finetune.evalsets, as `scoring` says), save the adapter to out_dir/adapter and the figures to
    out_dir/result.json. Under torchrun every process trains its share of each batch (DDP); the
    first one reports progress, scores the sets, writes the outputs and returns the Result (the
    others None)."""
    import torch  # heavy imports only when training
    from datasets import Dataset
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl.trainer.dpo_config import DPOConfig
    from trl.trainer.dpo_trainer import DPOTrainer
    from trl.trainer.sft_config import SFTConfig
    from trl.trainer.sft_trainer import SFTTrainer

    if not evaluation:
        raise TrainingError("the dataset has no held-out rows to evaluate on",
                            hint="import it with finetune.eval_fraction > 0")
    tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True, dtype=torch.float32,
                                                 **_quantization(hp))
    checkpoints = out_dir / "checkpoints"
    options: dict[str, Any] = dict(
        output_dir=str(checkpoints), max_steps=hp.max_steps, num_train_epochs=hp.epochs,
        per_device_train_batch_size=hp.batch_size, per_device_eval_batch_size=hp.batch_size,
        learning_rate=hp.learning_rate, logging_steps=1, save_steps=hp.save_steps, save_total_limit=2,
        report_to=[], use_cpu=not torch.cuda.is_available(), seed=hp.seed, data_seed=hp.seed,
        # TRL turns on bf16 autocast and gradient checkpointing by default. bf16 suits a GPU; on a CPU
        # it ran 4x slower here. Checkpointing cost 1.5x the time on a CPU and 2x on a GPU, so it is
        # on only where the job's budget needs it (`checkpointing`, the runner's choice).
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        gradient_checkpointing=checkpointing,
        max_length=hp.max_length, dataloader_num_workers=0, disable_tqdm=True,
        include_num_input_tokens_seen="non_padding")
    peft_config = LoraConfig(r=hp.rank, lora_alpha=hp.alpha, lora_dropout=hp.dropout, target_modules="all-linear",
                             task_type="CAUSAL_LM")
    trainer: SFTTrainer | DPOTrainer
    if hp.method == "dpo":  # its reference model is the base itself: the adapter switched off
        trainer = DPOTrainer(model=model, args=DPOConfig(**options, beta=hp.beta), processing_class=tokenizer,
                             peft_config=peft_config, train_dataset=Dataset.from_list(train),
                             eval_dataset=Dataset.from_list(evaluation))
    else:  # rows tokenized with their labels as the sharded trainer has them (finetune.chat_tokens)
        data = {"train_dataset": _tokenized(Dataset, tokenizer, base, train, hp.max_length),
                "eval_dataset": _tokenized(Dataset, tokenizer, base, evaluation, hp.max_length),
                "processing_class": tokenizer, "peft_config": peft_config}
        sft = SFTTrainer if torch.cuda.is_available() else _cpu_sft_trainer(SFTTrainer)
        trainer = sft(model=model, args=SFTConfig(**options), **data)
    phases = Phases(on_progress)
    trainer.add_callback(_progress_callback(TrainerCallback, phases.trained, on_beat))
    adapted = trainer.model
    if not isinstance(adapted, PeftModel):  # the trainer wraps the model because peft_config is given
        raise TrainingError(f"the trainer did not add LoRA layers to {base} (got {type(adapted).__name__})")
    if not torch.cuda.is_available():
        _draw_only_dropped(adapted)
    with adapted.disable_adapter():
        base_loss = trainer.evaluate()["eval_loss"]
    resume = _last_checkpoint(checkpoints)
    started = time.monotonic()
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    seconds = time.monotonic() - started  # training only: train_tokens / seconds is its throughput
    evaluated = phases.gate(gate_evaluations(eval_sets or {}, scoring or Scoring()), step=trainer.state.global_step,
                            max_steps=trainer.state.max_steps) if trainer.is_world_process_zero() else _nothing
    adapter_loss = trainer.evaluate()["eval_loss"]
    if not trainer.is_world_process_zero():
        return None
    adapter_dir = out_dir / "adapter"
    adapted.save_pretrained(str(adapter_dir))
    scores = _score_sets(adapted, tokenizer, eval_sets or {}, scoring or Scoring(), on_beat, evaluated)
    result = Result(adapter_dir=adapter_dir, base_eval_loss=base_loss, adapter_eval_loss=adapter_loss,
                    steps=trainer.state.global_step, train_tokens=trainer.state.num_input_tokens_seen, seconds=seconds,
                    resumed_from=resume.name if resume else None, eval_sets=scores,
                    processes=trainer.args.world_size)
    (out_dir / "result.json").write_text(json.dumps({**asdict(result), "adapter_dir": str(adapter_dir)}, indent=1))
    return result


def load_result(out_dir: Path) -> Result:
    """The sandboxed trainer's result.json; the adapter is always out_dir/adapter, whatever the
    file says (the trainer does not choose what the worker copies to the store)."""
    found = read_small_file(out_dir / "result.json", MAX_RESULT_BYTES)
    if found is None:
        raise TrainingError(f"the trainer left no readable result.json (a plain file of at most {MAX_RESULT_BYTES} "
                            f"bytes) in {out_dir}")
    try:
        raw = json.loads(found[0])
        result = Result(**{**raw, "adapter_dir": out_dir / "adapter"})
        kinds: dict[str, tuple[type, ...]] = {"base_eval_loss": (int, float), "adapter_eval_loss": (int, float),
                                              "seconds": (int, float), "steps": (int,), "train_tokens": (int,),
                                              "processes": (int,), "eval_sets": (dict,)}
        for name, allowed in kinds.items():
            value = getattr(result, name)
            if isinstance(value, bool) or not isinstance(value, allowed):
                raise ValueError(f"{name} is a {type(value).__name__}")
        if result.resumed_from is not None and not isinstance(result.resumed_from, str):
            raise ValueError("resumed_from is not a checkpoint's name")
        return result
    except (ValueError, TypeError) as exc:
        raise TrainingError(f"the trainer's result.json is not a result: {exc}") from exc


def gate_evaluations(eval_sets: dict[str, list[dict[str, Any]]], scoring: Scoring) -> int:
    """The gate's evaluations: each set at each seed (base and adapter)."""
    return len(eval_sets) * scoring.seeds


def scores_over_seeds(eval_sets: dict[str, list[dict[str, Any]]], seeds: int,
                      score: Callable[[str, int, bool], float],
                      evaluated: Callable[[], None]) -> dict[str, dict[str, list[float]]]:
    """Each set's score at each seed, `score(kind, seed, adapter)` for the base and the adapter;
    `evaluated` as each set is done at each seed."""
    scores: dict[str, dict[str, list[float]]] = {}
    for kind in eval_sets:
        per_seed: dict[str, list[float]] = {"base": [], "adapter": []}
        for seed in range(seeds):
            per_seed["base"].append(score(kind, seed, False))
            per_seed["adapter"].append(score(kind, seed, True))
            evaluated()
        scores[kind] = per_seed
    return scores


def _nothing() -> None:
    """What a rank but the first does as an evaluation is done: only the first reports."""


def _score_sets(model: Any, tokenizer: Any, eval_sets: dict[str, list[dict[str, Any]]], scoring: Scoring,
                beat: Callable[[], None], evaluated: Callable[[], None], *,
                synced: bool = False) -> dict[str, dict[str, list[float]]]:
    """Each set's score per seed with the adapter off (the base) and on (a beat each batch;
    `evaluated` as each set is done at each seed). `synced`: every rank of a sharded model
    generates the same answers in step (each forward gathers the layers from all ranks, so none
    may stop before the others)."""
    import torch

    sampling = ({"do_sample": False} if scoring.seeds == 1
                else {"do_sample": True, "temperature": scoring.temperature, "top_p": 1.0, "top_k": 0})
    tokenizer.padding_side = "left"  # generation continues each prompt where it ends
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # None too: one prompt a batch, nothing to pad

    def answers(prompts: list[list[int]], seed: int) -> list[str]:
        torch.manual_seed(seed)
        found: dict[int, str] = {}
        for batch in _batches(prompts, padded=tokenizer.pad_token is not None):
            inputs = tokenizer.pad({"input_ids": [prompts[i] for i in batch]}, return_tensors="pt").to(model.device)
            with torch.no_grad():
                output = model.generate(**inputs, max_new_tokens=ANSWER_TOKENS, pad_token_id=tokenizer.pad_token_id,
                                        synced_gpus=synced, **sampling)
            texts = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
            found.update(zip(batch, texts, strict=True))
            beat()
        return [found[i] for i in range(len(prompts))]

    model.eval()
    prompts = {kind: [tokenizer.apply_chat_template(item["messages"], add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"] for item in items]
               for kind, items in eval_sets.items()}

    def score(kind: str, seed: int, adapter: bool) -> float:
        with contextlib.nullcontext() if adapter else model.disable_adapter():
            return evalsets.score(eval_sets[kind], answers(prompts[kind], seed))

    return scores_over_seeds(eval_sets, scoring.seeds, score, evaluated)


def _batches(prompts: list[list[int]], *, padded: bool) -> list[list[int]]:
    """The prompts' indices in batches of similar lengths: at most SCORE_BATCH prompts and
    SCORE_TOKENS padded tokens each (a long operator prompt is not padded 32 times over); one
    prompt a batch when nothing can pad."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches: list[list[int]] = []
    for i in order:
        if batches and padded and len(batches[-1]) < SCORE_BATCH and \
                (len(batches[-1]) + 1) * len(prompts[i]) <= SCORE_TOKENS:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def _tokenized(dataset: Any, tokenizer: Any, base: Path, rows: list[dict[str, Any]], max_length: int) -> Any:
    """A TRL dataset of the rows' input ids and labels (TRL trains on labels given as they are)."""
    return dataset.from_list([{"input_ids": ids, "labels": labels}
                              for ids, labels in token_rows(tokenizer, base, rows, max_length)])


def _quantization(hp: Hyperparameters) -> dict[str, Any]:
    """QLoRA: the base in 4-bit NF4 through bitsandbytes (double-quantized), LoRA on top."""
    if not hp.qlora:
        return {}
    import torch
    from transformers import BitsAndBytesConfig

    # transformers leaves BitsAndBytesConfig's __init__ unannotated.
    return {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                      bnb_4bit_use_double_quant=True,
                                                      bnb_4bit_compute_dtype=torch.float32)}  # type: ignore[no-untyped-call]


def _cpu_sft_trainer(base: type) -> Any:
    """SFTTrainer whose training loss projects only the labelled positions onto the vocabulary.

    TRL's fused LM head scores only those positions with its Triton kernel; on a CPU it scores
    every position (the prompt and the padding too), adds entropy and accuracy for its logs, and
    computes the projection again in the backward pass: over a quarter of a step on the demo
    model, whose chat rows are two thirds prompt. Here the logits are kept from the first column
    holding a label in any row to the end (`logits_to_keep`), and the loss is TRL's: the labelled
    tokens' summed negative log-likelihood over `num_items_in_batch`. Evaluation stays TRL's own,
    so held-out losses are computed as before."""
    import torch
    import torch.nn.functional as F

    class CpuSFTTrainer(base):  # type: ignore[misc]  # a class passed in, to import TRL lazily
        def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            if return_outputs or not model.training:
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            labels = inputs["labels"]
            # The logits at position i predict the label at i + 1; with no label at all, all are kept.
            first = int((labels[:, 1:] != -100).any(0).int().argmax()) + 1
            kept = labels.size(1) - first + 1
            logits = model(**{k: v for k, v in inputs.items() if k != "labels"}, use_cache=False,
                           logits_to_keep=kept).logits[:, :-1]
            targets = labels[:, first:]
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
            count = (targets != -100).sum() if num_items_in_batch is None else num_items_in_batch
            loss = loss / torch.as_tensor(count).clamp(min=1)
            if self.args.average_tokens_across_devices and num_items_in_batch is not None:
                loss = loss * self.accelerator.num_processes  # as TRL does: DDP averages over processes
            return loss

    return CpuSFTTrainer


def _draw_only_dropped(model: Any) -> None:
    """Swap the LoRA layers' dropout for one that draws only the dropped positions.

    On a CPU, torch's dropout draws a random number for every element, one after another (5 ns
    each): a fifth of a LoRA step on the demo model. The gaps between the dropped elements of
    such a Bernoulli process are geometric, so drawing the gaps (p * n numbers, 0.05 * n by
    default) drops each element with the same probability, independently, in half the time."""
    import torch
    from peft.tuners.lora import LoraLayer

    class GapDropout(torch.nn.Module):
        def __init__(self, p: float) -> None:
            super().__init__()
            self.p = p

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not self.training:
                return x
            n = x.numel()
            ends = torch.zeros(1, dtype=torch.float64)  # 1-based positions of the dropped elements
            while ends[-1] < n:  # enough gaps to pass the end, nearly always at the first draw
                gaps = torch.empty(int(n * self.p * 1.1) + 16, dtype=torch.float64).geometric_(self.p)
                ends = torch.cat([ends, ends[-1] + gaps.cumsum(0)])
            mask = torch.full((n,), 1 / (1 - self.p), dtype=x.dtype, device=x.device)
            mask[ends[(ends > 0) & (ends <= n)].long() - 1] = 0
            return x * mask.view(x.shape)

    for module in model.modules():
        if isinstance(module, LoraLayer):
            for name, dropout in module.lora_dropout.items():
                # PEFT's Identity when the dropout is 0; a Dropout DPO's trainer turned off (p = 0) stays
                if isinstance(dropout, torch.nn.Dropout) and 0 < dropout.p < 1:
                    module.lora_dropout[name] = GapDropout(dropout.p)


def _last_checkpoint(checkpoints: Path) -> Path | None:
    """The newest whole checkpoint: the trainer writes trainer_state.json last, so a run killed
    while it wrote one resumes from the one before."""
    found = sorted((state.parent for state in checkpoints.glob("checkpoint-*/trainer_state.json")),
                   key=lambda p: int(p.name.split("-")[1]))
    return found[-1] if found else None


def _progress_callback(base: type, report: Callable[[Progress], None], beat: Callable[[], None]) -> Any:
    """A TrainerCallback turning the first process's log events into Progress (step, loss,
    tokens/s of all processes, ETA), and beating at each step and evaluation batch."""

    class ProgressCallback(base):  # type: ignore[misc]  # a class passed in, to import transformers lazily
        started = time.monotonic()
        tokens_at_start = 0

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            beat()

        def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            beat()

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.started, self.tokens_at_start = time.monotonic(), state.num_input_tokens_seen
            self.steps_at_start = state.global_step

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
                   **kwargs: Any) -> None:
            if logs is None or "loss" not in logs or not state.is_world_process_zero:
                return  # evaluation logs, or another process's
            elapsed = time.monotonic() - self.started
            done = state.global_step - self.steps_at_start
            rate = (state.num_input_tokens_seen - self.tokens_at_start) / elapsed if elapsed else 0.0
            eta = elapsed / done * (state.max_steps - state.global_step) if done else None
            report(Progress(step=state.global_step, max_steps=state.max_steps, loss=logs["loss"],
                            tokens_per_s=rate, eta_s=eta))

    return ProgressCallback()
