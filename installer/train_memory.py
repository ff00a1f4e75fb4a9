"""The training memory model: what one rank holds while it trains a LoRA or QLoRA adapter on a
base sharded with PyTorch FSDP2 over N ranks, from the model's config.json alone.

Per rank, in bytes:
- base shard: the frozen base over N ranks (FSDP2 shards every parameter on dim 0, experts
  included). LoRA keeps it in the compute dtype; QLoRA keeps every decoder linear in NF4 packed
  into compute-dtype storage (bitsandbytes' `quant_storage`, the FSDP+QLoRA recipe: Answer.AI,
  "Enabling 70B Finetuning on Consumer GPUs", 2024), sharded like any parameter, while its quant
  state (double-quantized absmax, installer.memory.FORMAT_BYTES["nf4"] less the 4 bits) is a
  module attribute FSDP does not shard (bitsandbytes keeps a copy on the Linear4bit module for
  fix_4bit_weight_quant_state_from_module): whole on every rank. Embeddings, norms, routers and
  lm_head stay in the compute dtype.
- adapter: LoRA's A (r x in) and B (out x r) of every targeted linear, kept in fp32 (PEFT's
  autocast_adapter_dtype) and sharded: the fp32 master (4 B), its gradient (4 B) and AdamW's two
  moments (8 B) per adapter parameter, over N (FSDP2 shards parameters, gradients and optimizer
  state alike: the fully_shard contract).
- activations: what autograd saves for backward for S x B tokens, counted by tensor in the way of
  Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022, sec.
  4.1), with memory-efficient SDPA (no S^2 score matrix: q, k, v, the output and the fp32
  log-sum-exp are saved) and LoRA's dropout (its output and a 1-byte mask per adapted input).
  With gradient checkpointing per decoder layer (transformers' gradient_checkpointing_enable,
  torchtune's activation checkpointing) only each layer's input is kept, plus one layer's full
  set while it is recomputed. The loss adds the logits, their fp32 copy and the saved log-softmax.
- collective buffers: FSDP2 all-gathers one unit (a decoder layer) before using it and prefetches
  the next, so two of the largest unsharded units are live at once, plus that unit's unsharded
  adapter gradients before their reduce-scatter; the root unit (embeddings, final norm, lm_head)
  stays unsharded from forward through backward (fully_shard's reshard_after_forward is False for
  the root). QLoRA adds the largest linear dequantized to the compute dtype for its matmul.
  One rank trains without FSDP: no buffers.
- runtime: a fixed overhead (on a GPU: the CUDA context, NCCL and cuBLAS workspaces, as the
  serving model's non-torch reserve; on a CPU: the interpreter with torch, transformers, PEFT
  and TRL imported and their libraries mapped, 0.82 GiB: a rank of a model of a few MB at its peak).
- allocator (a CPU only): what glibc keeps of each step's freed buffers. Where a token row of the
  hidden size (S x B x hidden values) is under the trainer's mmap threshold
  (appliance.job_fit.CPU_MMAP_THRESHOLD), a step's activations, their gradients in the backward
  pass and the loss's come from malloc's arenas, which keep them: 0.7 x the activations, fitted on
  the demo model's ranks at 1 and 2 processes and 55-token rows (peaks 2.24 and 1.67 GiB: the
  estimate 1.00 x both) and checked on a tiny MoE (1.05-1.09 x its ranks' peaks, 2 and 4 ranks).
  Larger rows are mapped and go back: none (the demo model at 256 and 512 tokens x 2 rows, 0.95 x
  and 0.91 x its peak). The tensors autograd saves are 0.89 x the activations counted. A GPU's
  caching allocator's slack is in the planner's utilization margin instead.

Compute dtype: bf16 on a GPU; fp32 on a CPU, as finetune/train.py loads the base there; or as
the trainer says (TrainSpec.dtype).
The figures are a rank's peak resident memory. Without the trainer's fixed mmap threshold
(MALLOC_MMAP_THRESHOLD_) glibc's dynamic one keeps larger freed buffers in the heap too, and a
CPU process's peak sat 1.13-1.24 x above the live memory on the demo model (bench/plan_train.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from appliance.errors import Invalid
from appliance.job_fit import CPU_MMAP_THRESHOLD
from installer.memory import FORMAT_BYTES, GIB, NON_TORCH_BYTES, count_params
from installer.model_config import ModelShape

Method = Literal["lora", "qlora"]
Device = Literal["cuda", "cpu"]
METHODS: tuple[Method, ...] = ("lora", "qlora")
TARGETS = ("attention", "mlp", "shared_experts", "routed_experts")
# What the trainer's target_modules="all-linear" reaches: transformers 5 stores an MoE's routed
# experts as fused 3-D parameters, not nn.Linear, so they get adapters only when asked for.
DEFAULT_TARGETS: tuple[str, ...] = ("attention", "mlp", "shared_experts")
Dtype = Literal["bf16", "fp32"]
DTYPE_BYTES: dict[Dtype, int] = {"bf16": 2, "fp32": 4}
DEVICE_DTYPE: dict[Device, Dtype] = {"cuda": "bf16", "cpu": "fp32"}
RUNTIME_BYTES = {"cuda": NON_TORCH_BYTES, "cpu": int(0.82 * GIB)}
ALLOCATOR_SLACK = {"cuda": 0.0, "cpu": 0.7}  # of the activations: what malloc keeps of a step's buffers
ADAPTER_STATE_BYTES = 4 + 4 + 8  # fp32 master, fp32 gradient, AdamW's two fp32 moments
NF4_PACKED = 0.5  # two 4-bit values a byte
NF4_STATE = FORMAT_BYTES["nf4"] - NF4_PACKED  # absmax per 64, double-quantized
MAX_SEQ_LEN = 1 << 24
MAX_BATCH = 1 << 16
MAX_RANK = 1 << 14


@dataclass(frozen=True)
class TrainSpec:
    """What is trained, and how: the method, LoRA's rank, tokens per row and rows per micro-batch."""

    method: Method
    rank: int
    seq_len: int
    batch: int
    targets: tuple[str, ...] = DEFAULT_TARGETS
    dropout: float = 0.05  # the trainer's default LoRA dropout
    dtype: Dtype | None = None  # the base's and the activations' dtype; None: the device's (DEVICE_DTYPE)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise Invalid(f"method {self.method!r}: not one of {', '.join(METHODS)}")
        for name, value, limit in (("rank", self.rank, MAX_RANK), ("seq_len", self.seq_len, MAX_SEQ_LEN),
                                   ("batch", self.batch, MAX_BATCH)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
                raise Invalid(f"{name} {value!r}: must be an integer from 1 to {limit}")
        unknown = sorted(set(self.targets) - set(TARGETS))
        if unknown or not self.targets:
            raise Invalid(f"targets {', '.join(unknown) or '(none)'}: give one or more of {', '.join(TARGETS)}")
        if not 0 <= self.dropout < 1:
            raise Invalid(f"dropout {self.dropout!r}: must be from 0 to below 1")
        if self.dtype is not None and self.dtype not in DTYPE_BYTES:
            raise Invalid(f"dtype {self.dtype!r}: not one of {', '.join(DTYPE_BYTES)}")

    def compute_dtype(self, device: Device) -> Dtype:
        return self.dtype or DEVICE_DTYPE[device]


@dataclass(frozen=True)
class RankMemory:
    """One rank's bytes while it trains, and the activations both ways."""

    base_shard: int
    quant_state: int  # QLoRA's, whole on every rank
    adapter: int  # fp32 master shard
    optimizer: int  # gradient shard + AdamW moments
    activations: int  # as chosen (with or without checkpointing)
    activations_full: int
    activations_checkpointed: int
    buffers: int
    runtime: int
    allocator: int  # a CPU's malloc keeps a share of each step's freed buffers
    checkpointing: bool

    @property
    def total(self) -> int:
        return (self.base_shard + self.quant_state + self.adapter + self.optimizer + self.activations
                + self.buffers + self.runtime + self.allocator)

    def figures(self) -> dict[str, int]:
        """The split by name, largest first: what a refusal names."""
        parts = {"base shard": self.base_shard, "quant state": self.quant_state, "adapter": self.adapter,
                 "gradients and optimizer": self.optimizer,
                 f"activations ({'with' if self.checkpointing else 'without'} checkpointing)": self.activations,
                 "collective buffers": self.buffers, "runtime": self.runtime,
                 "allocator's kept buffers": self.allocator}
        return dict(sorted(((k, v) for k, v in parts.items() if v), key=lambda kv: -kv[1]))


@dataclass(frozen=True)
class _Linears:
    """A layer's linear weights as (in, out), by block."""

    attention: dict[str, tuple[int, int]]
    mlp: list[tuple[int, int]]  # a dense layer's
    expert: list[tuple[int, int]]  # one routed expert's
    shared: list[tuple[int, int]]  # the shared experts', fused as one MLP


def attention_linears(model: ModelShape) -> dict[str, tuple[int, int]]:
    """The projections of one attention block, (in, out) as transformers builds them."""
    h = model.hidden
    if model.mla is None:
        q, kv = model.heads * model.head_dim, model.kv_heads * model.head_dim
        return {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h)}
    m = model.mla
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    parts = {"kv_a": (h, m.kv_lora_rank + m.qk_rope_head_dim),
             "kv_b": (m.kv_lora_rank, model.heads * (m.qk_nope_head_dim + m.v_head_dim)),
             "o": (model.heads * m.v_head_dim, h)}
    if m.q_lora_rank:
        return parts | {"q_a": (h, m.q_lora_rank), "q_b": (m.q_lora_rank, model.heads * qk)}
    return parts | {"q": (h, model.heads * qk)}


def _linears(model: ModelShape) -> _Linears:
    h, experts = model.hidden, model.experts

    def swiglu(inner: int) -> list[tuple[int, int]]:
        return [(h, inner), (h, inner), (inner, h)]  # gate, up, down

    return _Linears(attention=attention_linears(model), mlp=swiglu(model.intermediate) if model.intermediate else [],
                    expert=swiglu(experts.intermediate) if experts else [],
                    shared=swiglu(experts.shared * experts.intermediate) if experts and experts.shared else [])


def _lora(shapes: list[tuple[int, int]], rank: int) -> int:
    return sum(rank * (i + o) for i, o in shapes)


@dataclass(frozen=True)
class AdapterParams:
    """LoRA parameters of one dense layer, one MoE layer, and in all."""

    dense_layer: int
    moe_layer: int
    total: int


def adapter_params(model: ModelShape, spec: TrainSpec) -> AdapterParams:
    linears, r = _linears(model), spec.rank
    attention = _lora(list(linears.attention.values()), r) if "attention" in spec.targets else 0
    dense = attention + (_lora(linears.mlp, r) if "mlp" in spec.targets else 0)
    moe = attention
    if model.experts is not None:
        moe += _lora(linears.shared, r) if "shared_experts" in spec.targets else 0
        moe += model.experts.routed * _lora(linears.expert, r) if "routed_experts" in spec.targets else 0
    params = count_params(model)
    return AdapterParams(dense, moe, params.dense_layers * dense + params.moe_layers * moe)


def _layer_bytes(model: ModelShape, method: Method, compute: int) -> tuple[float, float, int]:
    """One dense and one MoE decoder layer's base weights as stored, and the linear parameters
    of the whole model (whose quant state QLoRA keeps)."""
    params = count_params(model)
    linear_bytes = NF4_PACKED if method == "qlora" else compute
    attention_linear = sum(i * o for i, o in attention_linears(model).values())
    plain_attention = params.layer_attention - attention_linear + params.layer_norms
    dense = attention_linear * linear_bytes + plain_attention * compute + params.layer_dense_mlp * linear_bytes
    moe_linear = params.routed * params.expert + params.layer_shared
    moe = (attention_linear + moe_linear) * linear_bytes + (plain_attention + params.layer_router) * compute
    linear = (params.dense_layers * (attention_linear + params.layer_dense_mlp)
              + params.moe_layers * (attention_linear + moe_linear))
    return dense, moe, linear


def _layer_activations(model: ModelShape, spec: TrainSpec, compute: int, moe: bool) -> int:
    """Bytes one decoder layer saves for backward (Korthikanti et al. 2022, sec. 4.1, by tensor).
    The inputs of the projections are counted whether or not they get adapters (a frozen
    projection's input is often saved by its neighbour anyway): a slight overestimate."""
    h = model.hidden
    elements = 2 * h + h  # each RMSNorm's input; the normed input to the attention projections
    if model.mla is None:
        q, kv = model.heads * model.head_dim, model.kv_heads * model.head_dim
        elements += q + 2 * kv + q  # q, k, v for SDPA and its output (o_proj's input)
    else:
        m = model.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        # q_a's output and its norm's; kv_a's output and its norm's; q, k, v and the output.
        elements += 2 * (m.q_lora_rank or 0) + (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
        elements += 2 * model.heads * qk + 2 * model.heads * m.v_head_dim
    fp32 = model.heads * 4  # SDPA's log-sum-exp per head
    linears = _linears(model)
    adapted = list(linears.attention.values()) if "attention" in spec.targets else []
    experts = model.experts
    if moe and experts is not None:
        # The normed input; each MLP's gate, silu(gate), up and their product (down's input): the
        # shared experts' for every token, the routed ones' for each of its top-k copies, with the
        # gathered input and the weighted output.
        elements += h + 4 * experts.shared * experts.intermediate
        elements += experts.top_k * (2 * h + 4 * experts.intermediate)
        fp32 += experts.routed * 4  # the router's scores
        adapted += linears.shared if "shared_experts" in spec.targets else []
        adapted += linears.expert * experts.top_k if "routed_experts" in spec.targets else []
    else:
        elements += h + 4 * model.intermediate
        adapted += linears.mlp if "mlp" in spec.targets else []
    # LoRA: A's output (r values) for B; with dropout, its output and 1-byte mask on each input.
    lora = sum(spec.rank * compute + (i * (compute + 1) if spec.dropout else 0) for i, _ in adapted)
    return spec.seq_len * spec.batch * (elements * compute + fp32 + lora)


def rank_memory(model: ModelShape, spec: TrainSpec, ranks: int, device: Device,
                checkpointing: bool) -> RankMemory:
    """One rank's memory training `spec` on `ranks` ranks, with or without checkpointing."""
    if ranks < 1:
        raise Invalid(f"ranks {ranks}: must be at least 1")
    compute = DTYPE_BYTES[spec.compute_dtype(device)]
    params = count_params(model)
    dense_layer, moe_layer, linear = _layer_bytes(model, spec.method, compute)
    edges = (params.embed + params.lm_head + params.final_norm) * compute
    base = params.dense_layers * dense_layer + params.moe_layers * moe_layer + edges
    adapters = adapter_params(model, spec)
    full, checkpointed = activation_bytes(model, spec, device)
    buffers = 0
    if ranks > 1:
        adapter_unit = max(adapters.dense_layer if params.dense_layers else 0,
                           adapters.moe_layer if params.moe_layers else 0)
        unit = max(dense_layer if params.dense_layers else 0.0, moe_layer if params.moe_layers else 0.0)
        # All-gathered in the compute dtype (MixedPrecisionPolicy's param_dtype); gradients reduced in fp32.
        buffers = int(2 * (unit + adapter_unit * compute) + adapter_unit * 4 + edges)
    if spec.method == "qlora":
        buffers += _largest_linear(model) * compute
    activations = checkpointed if checkpointing else full
    return RankMemory(
        base_shard=int(base / ranks), quant_state=int(linear * NF4_STATE) if spec.method == "qlora" else 0,
        adapter=-(-adapters.total * 4 // ranks), optimizer=-(-adapters.total * (ADAPTER_STATE_BYTES - 4) // ranks),
        activations=activations, activations_full=full, activations_checkpointed=checkpointed, buffers=buffers,
        runtime=RUNTIME_BYTES[device], allocator=_allocator(model, spec, compute, device, activations),
        checkpointing=checkpointing)


def _allocator(model: ModelShape, spec: TrainSpec, compute: int, device: Device, activations: int) -> int:
    """What a CPU's malloc keeps of a step's freed buffers: where they are under the mmap threshold."""
    row = spec.seq_len * spec.batch * model.hidden * compute
    return int(ALLOCATOR_SLACK[device] * activations) if row < CPU_MMAP_THRESHOLD else 0


def _largest_linear(model: ModelShape) -> int:
    linears = _linears(model)
    shapes = [*linears.attention.values(), *linears.mlp, *linears.expert, *linears.shared]
    return max(i * o for i, o in shapes)


def activation_bytes(model: ModelShape, spec: TrainSpec, device: Device) -> tuple[int, int]:
    """Activations without and with per-layer checkpointing, the loss's logits included."""
    compute = DTYPE_BYTES[spec.compute_dtype(device)]
    params = count_params(model)
    tokens = spec.seq_len * spec.batch
    layers = []
    if params.dense_layers:
        layers.append(_layer_activations(model, spec, compute, moe=False))
    if params.moe_layers:
        layers.append(_layer_activations(model, spec, compute, moe=True))
    # The logits in the compute dtype, their fp32 copy for the loss and the saved log-softmax; the
    # final norm's input.
    loss = tokens * model.vocab * (compute + 4 + 4) + tokens * model.hidden * compute
    full = (params.dense_layers * (layers[0] if params.dense_layers else 0)
            + params.moe_layers * (layers[-1] if params.moe_layers else 0) + loss)
    checkpointed = model.layers * tokens * model.hidden * compute + max(layers) + loss
    return full, checkpointed
