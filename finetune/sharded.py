"""The sharded trainer (strategy `fsdp`): LoRA on a base whose parameters, gradients and optimizer
state are split over every training process with PyTorch FSDP2 (`fully_shard`).

The base is never whole in one process: each rank builds the model on the meta device, adds the
LoRA layers, shards every decoder layer and then the root, allocates only its own shards
(`to_empty`) and reads only its own slice of each tensor from the safetensors files. The LoRA
weights are then drawn from a generator seeded by the job's seed and each parameter's name, the
whole tensor on every rank (they are small) and each rank keeping its slice: the same seed gives
the same adapter at any number of ranks.

This is a plain loop, not TRL's or accelerate's: both load the checkpoint with `from_pretrained`
(accelerate's FSDP2 path loads it whole on the first process and broadcasts it), which is what
a base larger than one process's memory cannot afford. The loop does what the single-process
trainer's defaults do: AdamW (no weight decay), a learning rate decaying linearly to 0, gradients
clipped at norm 1, the loss on completion tokens only, summed and divided by the labelled tokens
of the whole (all ranks') batch.

QLoRA (the FSDP+QLoRA recipe, Answer.AI 2024, on FSDP2): every decoder linear is bitsandbytes'
Linear4bit with its NF4 values packed into float32 storage, a (values/8, 1) tensor that FSDP
shards on its rows like any parameter. Each rank reads one linear's weight at a time, quantizes
it whole (double-quantized absmax in blocks of 64, as the single-process trainer's
BitsAndBytesConfig) and keeps its own rows of the packed tensor; the quant state stays on the
module, whole on every rank, where bitsandbytes restores it to the gathered weight
(fix_4bit_weight_quant_state_from_module). Its CPU repacking for inference (which rewrites the
weight in place) is turned off: the gathered weight is FSDP's buffer, refilled at every gather.

MoE bases: the adapters go on every linear layer but the output head (attention projections,
shared experts' and routers' linears where they are `nn.Linear`); routed experts that the model
keeps as fused 3-D parameters get none and are sharded by FSDP like any other parameter (over
their first dimension, the experts).
"""

from __future__ import annotations

import json
import math
import os
import re
import resource
import socket
import sys
import time
import zlib
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from appliance.jobs import RANKS_DIR, Hyperparameters, Progress, RankMemory
from finetune import checkpoints
from finetune.chat_tokens import IGNORED, token_rows
from finetune.phases import Phases
from finetune.train import Result, Scoring, TrainingError, _nothing, _score_sets, gate_evaluations

QLORA_BLOCK = 64  # values per absmax: bitsandbytes' default, as the single-process trainer quantizes
FUSED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


def local_slice(global_shape: tuple[int, ...], rank: int, world: int) -> tuple[int, int]:
    """Rows [start, stop) of a tensor's first dimension that `rank` of `world` holds: FSDP2's
    Shard(0) split, torch.chunk's (ceil(rows / world) a rank; the last ones may hold fewer or none)."""
    if not global_shape:
        return (0, 0)
    rows = global_shape[0]
    size = math.ceil(rows / world)
    start = min(rank * size, rows)
    return start, min(start + size, rows)


def checkpoint_key(name: str) -> str:
    """The safetensors name of a PEFT-wrapped model's base parameter."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


def safetensors_index(base: Path) -> dict[str, Path]:
    """Tensor name -> the file that holds it (one model.safetensors, or an index of several)."""
    index = base / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: base / file for name, file in weight_map.items()}
    single = base / "model.safetensors"
    if not single.is_file():
        raise TrainingError(f"{base} holds no safetensors weights (model.safetensors or its index)",
                            hint="the sharded trainer reads only its own slices of safetensors files")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as handle:
        return {name: single for name in handle.keys()}  # safe_open is not a mapping


def batch_order(rows: int, global_batch: int, steps: int, seed: int) -> list[list[int]]:
    """The rows of each step's global batch: a permutation per epoch seeded by `seed` and the
    epoch, taken in order (a step's batch depends only on the seed and the step, so a resumed run
    picks up where it stopped with nothing else saved)."""
    import torch

    order: list[int] = []
    epoch = 0
    while len(order) < steps * global_batch:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        permutation = torch.randperm(rows, generator=generator).tolist()
        order += permutation[:len(permutation) - len(permutation) % global_batch] or permutation
        epoch += 1
    return [order[i * global_batch:(i + 1) * global_batch] for i in range(steps)]


def planned_steps(hp: Hyperparameters, rows: int, global_batch: int) -> int:
    if hp.max_steps > 0:
        return hp.max_steps
    return max(1, math.ceil(max(1, rows // global_batch) * hp.epochs))


def train_sharded(base: Path, train: list[dict[str, Any]], evaluation: list[dict[str, Any]], out_dir: Path,
                  hp: Hyperparameters, on_progress: Callable[[Progress], None] = lambda p: None,
                  eval_sets: dict[str, list[dict[str, Any]]] | None = None,
                  on_beat: Callable[[], None] = lambda: None, scoring: Scoring | None = None,
                  checkpointing: bool = False, node: int = 0) -> Result | None:
    """train.train_adapter's contract, sharded: every rank trains, evaluates and scores in step;
    the first writes out_dir/adapter (gathered once) and out_dir/result.json and returns the Result.
    `node`: this host's place in the job (0: the head, whose first process is rank 0): each rank's
    place, and so the shards it holds and checkpoints, is fixed by its host and local rank, never by
    the order in which torchrun's agents met."""
    import torch
    import torch.distributed as dist
    from torch.distributed.rendezvous import rendezvous

    if not evaluation:
        raise TrainingError("the dataset has no held-out rows to evaluate on",
                            hint="import it with finetune.eval_fraction > 0")
    if hp.method != "sft":
        raise TrainingError(f"the sharded trainer trains SFT only, not {hp.method}",
                            hint="set finetune.strategy = \"ddp\" for DPO on several processes")
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        # A store of this start's own (finetune.runner.FRESH_STORE): no dead rank's address in it.
        store, _, world = next(rendezvous("env://"))
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=job_rank(node, world), world_size=world)
    try:
        return _train(base, train, evaluation, out_dir, hp, on_progress, eval_sets or {}, on_beat,
                      scoring or Scoring(), checkpointing)
    finally:
        dist.destroy_process_group()


def job_rank(node: int, world: int) -> int:
    """This process's rank in the job: its host's place times the processes a host, plus its own
    place on the host (torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE); every host runs as many."""
    local, per_host = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if world % per_host or not 0 <= node < world // per_host:
        raise TrainingError(f"host {node} of a job of {world} processes at {per_host} a host: every host must run "
                            "as many processes, and the hosts be numbered from 0")
    return node * per_host + local


def _train(base: Path, train: list[dict[str, Any]], evaluation: list[dict[str, Any]], out_dir: Path,
           hp: Hyperparameters, on_progress: Callable[[Progress], None], eval_sets: dict[str, list[dict[str, Any]]],
           on_beat: Callable[[], None], scoring: Scoring, checkpointing: bool) -> Result | None:
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    rank, world, local = dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if torch.cuda.is_available() \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
    model = build_sharded(base, hp, device, checkpointing=checkpointing)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=hp.learning_rate, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    rows = token_rows(tokenizer, base, train, hp.max_length)
    global_batch = hp.batch_size * world
    steps = planned_steps(hp, len(rows), global_batch)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1 - step / steps))
    held_out = token_rows(tokenizer, base, evaluation, hp.max_length)
    base_loss = evaluate(model, held_out, hp.batch_size, pad, device, adapter=False, beat=on_beat)
    phases = Phases(on_progress)

    store = out_dir / "checkpoints"
    resumed = checkpoints.resume(store, model, optimizer, log=lambda line: print(line, flush=True))
    start = resumed.step if resumed else 0
    torch.manual_seed(hp.seed * 7919 + rank)  # dropout: each rank draws its own masks
    if resumed and resumed.rng is not None:
        torch.set_rng_state(resumed.rng)
    for _ in range(start):
        schedule.step()
    tokens = resumed.tokens if resumed else 0
    batches = batch_order(len(rows), global_batch, steps, hp.seed)
    model.train()
    started, loss = time.monotonic(), math.nan
    for step in range(start, steps):
        mine = batches[step][rank * hp.batch_size:(rank + 1) * hp.batch_size]
        loss, seen = train_step(model, [rows[i] for i in mine], pad, device, trainable, world)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += seen
        on_beat()
        if local == 0:  # each host's first process: the head's is the job's, a worker host's its node's
            elapsed, done = time.monotonic() - started, step + 1 - start
            phases.trained(Progress(step=step + 1, max_steps=steps, loss=loss,
                                 tokens_per_s=(tokens - (resumed.tokens if resumed else 0)) / elapsed if elapsed else 0,
                                 eta_s=elapsed / done * (steps - step - 1)))
            print(json.dumps({"step": step + 1, "loss": loss}), flush=True)
        if step + 1 == 1 or (step + 1) % hp.save_steps == 0:
            write_memory(out_dir, model, optimizer, rank)
        if (step + 1) % hp.save_steps == 0 and step + 1 < steps:
            checkpoints.save(store, step + 1, tokens, model, optimizer)
    seconds = time.monotonic() - started
    evaluated = phases.gate(gate_evaluations(eval_sets, scoring), step=steps, max_steps=steps) if rank == 0 \
        else _nothing
    write_memory(out_dir, model, optimizer, rank)
    adapter_loss = evaluate(model, held_out, hp.batch_size, pad, device, adapter=True, beat=on_beat)
    adapter_dir = out_dir / "adapter"
    gather_adapter(model, adapter_dir, rank)
    scores = _score_sets(model, tokenizer, eval_sets, scoring, on_beat, evaluated, synced=True)
    if rank != 0:
        return None
    result = Result(adapter_dir=adapter_dir, base_eval_loss=base_loss, adapter_eval_loss=adapter_loss, steps=steps,
                    train_tokens=tokens, seconds=seconds, resumed_from=f"checkpoint-{start}" if resumed else None,
                    eval_sets=scores, processes=world)
    (out_dir / "result.json").write_text(json.dumps({**asdict(result), "adapter_dir": str(adapter_dir)}, indent=1))
    return result


def build_sharded(base: Path, hp: Hyperparameters, device: Any, *, checkpointing: bool = False) -> Any:
    """The PEFT model with every decoder layer and the root sharded, this rank's slices of the
    base loaded and the LoRA weights drawn from the seed; with `checkpointing`, each decoder layer
    keeps only its input and recomputes its forward in the backward pass (non-reentrant, as FSDP2
    needs: the recomputation all-gathers the layer again through its hooks)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base, local_files_only=True)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    if checkpointing:
        skeleton.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if hp.qlora:
        four_bit_linears(skeleton)
    model = get_peft_model(skeleton, LoraConfig(r=hp.rank, lora_alpha=hp.alpha, lora_dropout=hp.dropout,
                                                target_modules=linear_targets(skeleton), task_type="CAUSAL_LM"))
    inner = model.get_base_model()
    for layer in decoder_layers(inner):
        fully_shard(layer)
    # The transformers model is the root, not PEFT's wrapper: generate() calls its forward, whose
    # hooks gather the embeddings and the head.
    fully_shard(inner)
    model.to_empty(device=device)
    with torch.no_grad():
        load_own_slices(model, base)
        draw_adapter(model, hp.seed)
        rebuild_rotary(inner, device)
    return model


def four_bit_linears(model: Any) -> None:
    """Every linear layer of the decoder layers (on the meta device) made bitsandbytes' NF4
    Linear4bit, its weight the packed (values/8, 1) float32 tensor that quantize_whole fills."""
    import torch
    from bitsandbytes.nn.modules import Linear4bit, Params4bit

    for layer in decoder_layers(model):
        for name, module in list(layer.named_modules()):
            if type(module) is not torch.nn.Linear:
                continue
            four_bit = Linear4bit(  # type: ignore[no-untyped-call]  # bitsandbytes is not annotated
                module.in_features, module.out_features, module.bias is not None, compute_dtype=torch.float32,
                compress_statistics=True, quant_type="nf4", quant_storage=torch.float32, device="meta")
            packed = (module.in_features * module.out_features + 1) // (2 * 4)
            four_bit.weight = Params4bit(torch.empty((packed, 1), dtype=torch.float32, device="meta"),
                                         requires_grad=False, compress_statistics=True, quant_type="nf4",
                                         quant_storage=torch.float32, module=four_bit, bnb_quantized=True)
            four_bit.support_avx512bf16_for_cpu = False
            four_bit.requires_grad_(False)
            layer.set_submodule(name, four_bit)


def is_four_bit(module: Any) -> bool:
    """A bitsandbytes 4-bit linear (never one where bitsandbytes was not even imported)."""
    modules = sys.modules.get("bitsandbytes.nn.modules")
    return modules is not None and isinstance(module, modules.Linear4bit)


def quantize_whole(module: Any, weight: Any) -> Any:
    """A linear's whole weight in NF4 as the single-process QLoRA trainer quantizes it; the quant
    state kept on the module (every rank holds it whole), the packed values returned."""
    import torch
    from bitsandbytes.functional import quantize_4bit

    packed, state = quantize_4bit(weight.to(torch.float32).contiguous(), blocksize=QLORA_BLOCK,
                                  compress_statistics=True, quant_type="nf4", quant_storage=torch.float32)
    module.quant_state = state
    return packed


def linear_targets(model: Any) -> list[str]:
    """The names of the model's linear layers but its output head: "all-linear" as the
    single-process trainer asks it of a dense model. Given a MoE, PEFT's "all-linear" also wraps
    the fused routed experts' parameters, which it refuses with dropout; here they get none."""
    import torch

    head = model.get_output_embeddings()
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear) and module is not head})


def decoder_layers(model: Any) -> list[Any]:
    """The transformer blocks (one FSDP unit each): the model's own list of layers."""
    import torch

    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) and module is not model:
            return list(layers)
    raise TrainingError(f"{type(model).__name__} has no list of decoder layers to shard")


def load_own_slices(model: Any, base: Path) -> None:
    """Copy into each parameter this rank's slice of its tensor in the checkpoint, read alone."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    index = safetensors_index(base)
    with ExitStack() as files:
        opened: dict[Path, Any] = {}

        def read(tensor: str, rows: slice | None, what: str) -> Any:
            """Rows of a checkpoint tensor (None: all of it, a scalar too)."""
            if tensor not in index:
                raise TrainingError(f"{base}: the checkpoint has no tensor {tensor!r} for parameter {what}")
            if index[tensor] not in opened:
                opened[index[tensor]] = files.enter_context(safe_open(str(index[tensor]), framework="pt"))
            source = opened[index[tensor]]
            return source.get_tensor(tensor) if rows is None else source.get_slice(tensor)[rows]

        for name, parameter in model.named_parameters():
            if ".lora_" in name:
                continue
            key = checkpoint_key(name)
            if key not in index and key == "lm_head.weight" and "model.embed_tokens.weight" in index:
                key = "model.embed_tokens.weight"  # tied: the head is the embeddings
            local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
            owner = model.get_submodule(name.rpartition(".")[0])
            if name.endswith(".weight") and is_four_bit(owner):  # quantized whole, this rank's rows kept
                start, stop = own_rows(parameter) if isinstance(parameter, DTensor) else (0, parameter.shape[0])
                local.copy_(quantize_whole(owner, read(key, None, name))[start:stop])
                continue
            if not parameter.dim():
                chunk = read(key, None, name)
            else:
                start, stop = own_rows(parameter) if isinstance(parameter, DTensor) else (0, parameter.shape[0])
                if key in index or not FUSED_EXPERTS.search(key):
                    chunk = read(key, slice(start, stop), name)
                else:
                    chunk = fused_experts(key, range(start, stop), partial(read, rows=None, what=name))
            local.copy_(chunk.to(local.dtype))


def fused_experts(key: str, experts: range, read: Callable[[str], Any]) -> Any:
    """A routed-experts parameter that transformers keeps fused (experts first) and checkpoints
    store one tensor per expert (Qwen-MoE's and DeepSeek's names): this rank's experts only.
    gate_up_proj is each expert's gate and up projections one above the other."""
    import torch

    prefix, fused = key.rsplit(".", 1)
    parts = []
    for expert in experts:
        if fused == "gate_up_proj":
            parts.append(torch.cat([read(f"{prefix}.{expert}.gate_proj.weight"),
                                    read(f"{prefix}.{expert}.up_proj.weight")]))
        else:
            parts.append(read(f"{prefix}.{expert}.down_proj.weight"))
    return torch.stack(parts) if parts else torch.empty(0)


def own_rows(parameter: Any) -> tuple[int, int]:
    """Rows of a Shard(0) DTensor this rank holds, as torch's DTensor computes them."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(parameter.shape, parameter.device_mesh,
                                                           parameter.placements)
    return offset[0], offset[0] + shape[0]


def draw_adapter(model: Any, seed: int) -> None:
    """LoRA A as PEFT draws it (Kaiming-uniform), B zero, from a generator seeded by the seed and
    the parameter's name: the whole (small) tensor on every rank, each rank keeping its rows."""
    import torch
    from torch.distributed.tensor import DTensor

    for name, parameter in model.named_parameters():
        if ".lora_" not in name:
            continue
        full = torch.zeros(parameter.shape, dtype=torch.float32)
        if ".lora_A." in name:
            generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            torch.nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
        local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
        start, stop = own_rows(parameter) if isinstance(parameter, DTensor) else (0, full.shape[0])
        local.copy_(full[start:stop].to(local.dtype))


def rebuild_rotary(model: Any, device: Any) -> None:
    """Rotary embeddings keep computed buffers that no checkpoint holds: `to_empty` left them
    uninitialised, so each is computed again by a fresh module of its class."""
    for module in model.modules():
        if hasattr(module, "original_inv_freq") and hasattr(module, "config"):
            fresh = type(module)(module.config)
            for name, buffer in fresh.named_buffers(recurse=False):
                getattr(module, name).copy_(buffer.to(device))


def padded(batch: list[tuple[list[int], list[int]]], pad: int, device: Any) -> tuple[Any, Any, Any]:
    import torch

    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORED, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, (row, row_labels) in enumerate(batch):
        ids[i, :len(row)], labels[i, :len(row)], mask[i, :len(row)] = (torch.tensor(row), torch.tensor(row_labels), 1)
    return ids.to(device), labels.to(device), mask.to(device)


def summed_loss(model: Any, batch: list[tuple[list[int], list[int]]], pad: int, device: Any) -> tuple[Any, Any]:
    """The batch's summed negative log-likelihood of its labelled tokens, and how many there are."""
    import torch.nn.functional as F

    ids, labels, mask = padded(batch, pad, device)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
    targets = labels[:, 1:]
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORED, reduction="sum")
    return loss, (targets != IGNORED).sum()


def train_step(model: Any, batch: list[tuple[list[int], list[int]]], pad: int, device: Any, trainable: list[Any],
               world: int) -> tuple[float, int]:
    """Forward and backward of this rank's part of a step, gradients clipped; the loss of the
    whole batch and the tokens all ranks fed. FSDP averages the gradients over the ranks, so each
    rank's sum is scaled by the ranks over the whole batch's labelled tokens."""
    import torch
    import torch.distributed as dist

    loss, labelled = summed_loss(model, batch, pad, device) if batch else (None, torch.zeros((), dtype=torch.long))
    totals = torch.stack([labelled.to(torch.float64).cpu(),
                          torch.tensor(float(sum(len(ids) for ids, _ in batch)), dtype=torch.float64)])
    dist.all_reduce(totals)
    count = totals[0].clamp(min=1)
    if loss is None:
        raise TrainingError("a rank got no rows for a step: the dataset is smaller than one batch per rank")
    (loss * world / count.to(loss.dtype)).backward()
    torch.nn.utils.clip_grad_norm_(trainable, 1.0)
    reported = loss.detach().to(torch.float64).cpu()
    dist.all_reduce(reported)
    return float(reported / count), int(totals[1])


def evaluate(model: Any, rows: list[tuple[list[int], list[int]]], batch_size: int, pad: int, device: Any, *,
             adapter: bool, beat: Callable[[], None]) -> float:
    """Mean loss per labelled held-out token, the rows shared out over the ranks (every rank runs
    the same number of batches: FSDP's gathers are collective)."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = rows[rank::world]
    batches = math.ceil(math.ceil(len(rows) / world) / batch_size)
    totals = torch.zeros(2, dtype=torch.float64)
    model.eval()
    with ExitStack() as stack:
        if not adapter:
            stack.enter_context(model.disable_adapter())
        for i in range(batches):
            part = mine[i * batch_size:(i + 1) * batch_size] or rows[:1]  # a filler keeps the ranks in step
            with torch.no_grad():
                loss, labelled = summed_loss(model, part, pad, device)
            if mine[i * batch_size:(i + 1) * batch_size]:
                totals += torch.stack([loss.double().cpu(), labelled.double().cpu()])
            beat()
    model.train()
    dist.all_reduce(totals)
    return float(totals[0] / totals[1].clamp(min=1))


def gather_adapter(model: Any, adapter_dir: Path, rank: int) -> None:
    """The adapter gathered once onto the first rank (in CPU memory) and saved as the
    single-process trainer saves it: adapter_model.safetensors and adapter_config.json."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                ignore_frozen_params=True))
    if rank == 0:
        model.save_pretrained(str(adapter_dir), state_dict=full)


def write_memory(out_dir: Path, model: Any, optimizer: Any, rank: int) -> None:
    """This rank's memory report, replaced whole (out_dir/ranks/rank-N.json)."""
    report = measure_memory(model, optimizer, rank)
    directory = out_dir / RANKS_DIR
    directory.mkdir(exist_ok=True)
    partial = directory / f".rank-{rank}.json.tmp"
    partial.write_text(report.model_dump_json())
    partial.replace(directory / f"rank-{rank}.json")


def measure_memory(model: Any, optimizer: Any, rank: int) -> RankMemory:
    from torch.distributed.tensor import DTensor

    def local_bytes(tensor: Any) -> int:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return int(local.numel() * local.element_size())

    base = adapter = 0
    for name, parameter in model.named_parameters():
        if ".lora_" in name:
            adapter += local_bytes(parameter)
        else:
            base += local_bytes(parameter)
    optimizer_bytes = sum(local_bytes(value) for state in optimizer.state.values() for value in state.values()
                          if hasattr(value, "numel") and value.dim())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return RankMemory(rank=rank, host=socket.gethostname(), pid=os.getpid(), base_parameter_bytes=base,
                      adapter_parameter_bytes=adapter, optimizer_bytes=optimizer_bytes, peak_rss_bytes=peak)
