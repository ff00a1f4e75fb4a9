"""The memory model: parameter counts, weight bytes per GPU under a layout and a weight format,
KV-cache bytes per token per GPU, reserves, and the KV capacity that is left.

Conventions (vLLM 0.32's): tensor parallelism (TP) splits attention heads, MLP columns and the
vocabulary; pipeline parallelism (PP) splits layers; an MoE model's routed experts are spread over
all TP x DP ranks of a stage (fused_moe/config.py, FusedMoEParallelConfig.make): with expert
parallelism (EP) as whole experts, E // ranks each and one more on the first E % ranks
(expert_map_manager.py, determine_expert_map), else as a 1/(TP x DP) slice of every expert. The
shared experts are split by TP, except with EP, TP > 1 and DP > 1, where every rank holds them
whole (models/deepseek_v2.py, sequence-parallel MoE). Embeddings, norms, routers and biases stay in
the model's dtype whatever the weight format.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from appliance.errors import ApplianceError
from appliance.records import SpeculativeConfig
from installer.model_config import ModelShape

GIB = 1 << 30
# Bytes per parameter of a linear weight, scales included: fp8 with one fp32 scale per 128x128
# block; int4 (AWQ/GPTQ) with an fp16 scale and a 4-bit zero per group of 128; nf4
# (bitsandbytes, double-quantized) with an 8-bit absmax per 64 and an fp32 per 256 absmaxes.
FORMAT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1 + 4 / (128 * 128), "int8": 1 + 2 / 128,
                "int4": 0.5 + 2.5 / 128, "nf4": 0.5 + 1 / 64 + 4 / (64 * 256)}
# What vLLM can do to a checkpoint at load time: quantize bf16/fp16 online to fp8 or nf4.
ONLINE = {"fp8", "nf4"}
MAX_BATCHED_TOKENS = 8192  # vLLM's chunked-prefill step: the activation peak it profiles
NON_TORCH_BYTES = 1 * GIB  # NCCL buffers, cuBLAS workspaces, the CUDA context
CUDA_GRAPH_BYTES = 1 * GIB  # captured graphs (0 on the CPU engine, which runs eagerly)


class FormatError(ApplianceError):
    """A weight format the checkpoint cannot be served in."""


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: bool = False

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def __str__(self) -> str:
        return f"TP{self.tp} x PP{self.pp} x DP{self.dp}" + (" + EP" if self.ep else "")


@dataclass(frozen=True)
class Params:
    """Parameter counts by part; `layer_*` are per layer of that kind."""

    embed: int
    lm_head: int
    final_norm: int
    layer_attention: int
    layer_norms: int
    layer_dense_mlp: int
    expert: int  # one routed expert
    layer_shared: int
    layer_router: int
    dense_layers: int
    moe_layers: int
    routed: int
    top_k: int

    @property
    def total(self) -> int:
        per_moe = self.routed * self.expert + self.layer_shared + self.layer_router
        return (self.embed + self.lm_head + self.final_norm
                + (self.dense_layers + self.moe_layers) * (self.layer_attention + self.layer_norms)
                + self.dense_layers * self.layer_dense_mlp + self.moe_layers * per_moe)

    @property
    def active(self) -> int:
        """Parameters one token passes through: only its top-k routed experts."""
        return self.total - self.moe_layers * (self.routed - self.top_k) * self.expert


def count_params(model: ModelShape) -> Params:
    h = model.hidden
    experts = model.experts
    moe_layers = experts.moe_layers if experts else 0
    return Params(
        embed=model.vocab * h, lm_head=0 if model.tied_embeddings else model.vocab * h, final_norm=h,
        layer_attention=sum(_attention_parts(model).values()) + _attention_extras(model),
        layer_norms=2 * h,
        layer_dense_mlp=3 * h * model.intermediate,
        expert=3 * h * experts.intermediate if experts else 0,
        layer_shared=experts.shared * 3 * h * experts.intermediate if experts else 0,
        layer_router=h * experts.routed if experts else 0,
        dense_layers=model.layers - moe_layers, moe_layers=moe_layers,
        routed=experts.routed if experts else 0, top_k=experts.top_k if experts else 0)


def _attention_parts(model: ModelShape) -> dict[str, int]:
    """Linear weights of one attention block, by projection."""
    h = model.hidden
    if model.mla is None:
        q = model.heads * model.head_dim
        kv = model.kv_heads * model.head_dim
        return {"q": h * q, "k": h * kv, "v": h * kv, "o": q * h}
    m = model.mla
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    parts = {"kv_a": h * (m.kv_lora_rank + m.qk_rope_head_dim),
             "kv_b": m.kv_lora_rank * model.heads * (m.qk_nope_head_dim + m.v_head_dim),
             "o": model.heads * m.v_head_dim * h}
    if m.q_lora_rank:
        parts |= {"q_a": h * m.q_lora_rank, "q_b": m.q_lora_rank * model.heads * qk}
    else:
        parts["q"] = h * model.heads * qk
    return parts


def _attention_extras(model: ModelShape) -> int:
    """Biases and norms inside the attention block (kept in the model's dtype)."""
    extras = 0
    if model.qkv_bias:
        extras += (model.heads + 2 * model.kv_heads) * model.head_dim
    if model.qk_norm:
        extras += 2 * model.head_dim
    if model.mla is not None:
        extras += model.mla.kv_lora_rank + (model.mla.q_lora_rank or 0)
    return extras


def checkpoint_format(model: ModelShape) -> str:
    """The weight format the checkpoint is stored in, from its quantization_config."""
    q = model.quantization
    if not q:
        return {"float16": "fp16", "float32": "fp32"}.get(model.dtype, "bf16")
    method = str(q.get("quant_method", "")).lower()
    if method == "fp8":
        return "fp8"
    if method in ("awq", "gptq") and q.get("bits", 4) == 4:
        return "int4"
    if method == "bitsandbytes":
        return "nf4" if q.get("load_in_4bit") else "int8"
    raise FormatError(f"{model.name}: quantization_config.quant_method {method!r} is not one the "
                      "memory model knows", hint="known: fp8, awq, gptq (4-bit), bitsandbytes")


def serving_format(model: ModelShape, requested: str | None) -> str:
    """The format the weights will have on the GPUs: the checkpoint's own unless `requested`
    names one vLLM can reach from it at load time."""
    stored = checkpoint_format(model)
    if requested is None or requested == stored:
        return stored
    if requested not in FORMAT_BYTES:
        raise FormatError(f"--format {requested!r} is not one of {', '.join(FORMAT_BYTES)}")
    if stored in ("fp32", "bf16", "fp16") and requested in ONLINE | {"bf16", "fp16"}:
        return requested
    raise FormatError(
        f"{model.name} is stored as {stored}; vLLM cannot serve it as {requested}",
        hint=f"from a bf16/fp16 checkpoint vLLM can quantize online to {' or '.join(sorted(ONLINE))}; "
             f"other formats need a checkpoint already in them")


@dataclass(frozen=True)
class GpuMemory:
    """One GPU's share under a layout (the fullest pipeline stage)."""

    weights: int
    kv_bytes_per_token: int
    reserve: int
    budget: int  # memory x utilisation

    @property
    def kv_cache(self) -> int:
        return max(0, self.budget - self.weights - self.reserve)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv_cache // self.kv_bytes_per_token


@dataclass(frozen=True)
class Speculative:
    """What speculative decoding adds to the fullest GPU: DeepSeek's multi-token-prediction (MTP)
    modules, or a draft model (its own weights and KV cache at the target's TP)."""

    mtp: bool = False
    draft: ModelShape | None = None
    draft_format: str | None = None
    draft_ref: str | None = None  # where the launch finds the draft model
    tokens: int = 1  # tokens proposed a step

    def vllm_config(self) -> SpeculativeConfig | None:
        """vLLM's --speculative-config (config/speculative.py: method "mtp", or "draft_model")."""
        if self.mtp:
            return SpeculativeConfig(method="mtp", num_speculative_tokens=self.tokens)
        if self.draft is not None:
            return SpeculativeConfig(method="draft_model", model=self.draft_ref or self.draft.name,
                                     num_speculative_tokens=self.tokens)
        return None

    def weight_bytes(self, model: ModelShape, layout: Layout, fmt: str) -> int:
        """vLLM's DeepSeekMultiTokenPredictorLayer (model_executor/models/deepseek_mtp.py): one decoder
        layer like the model's (an MoE layer, sharded the same way), an unsharded eh_proj (2h x h) and
        three norms in the model's dtype; it shares the target's lm_head, and its embedding too
        unless PP > 1 (llm_base_proposer.py, _maybe_share_embeddings). Counted on the fullest stage."""
        if self.draft is not None:
            return weight_bytes_per_gpu(self.draft, Layout(tp=layout.tp), self.draft_format or fmt)
        if not self.mtp:
            return 0
        dense_layer, moe_layer = _layer_bytes(model, layout, fmt)
        block = moe_layer if model.experts is not None else dense_layer
        own = (2 * model.hidden * model.hidden + 3 * model.hidden) * model.dtype_bytes
        embedding = model.vocab * model.hidden / layout.tp * model.dtype_bytes if layout.pp > 1 else 0
        return int(model.mtp_layers * (block + own) + embedding)

    def kv_bytes_per_token(self, model: ModelShape, layout: Layout) -> int:
        """An MTP module's attention keeps a KV cache like one more layer's; a draft model its own."""
        if self.draft is not None:
            return kv_bytes_per_token(self.draft, Layout(tp=layout.tp))
        return kv_bytes_per_token(model, Layout(tp=layout.tp), layers=model.mtp_layers) if self.mtp else 0


NO_SPECULATION = Speculative()


def _layer_bytes(model: ModelShape, layout: Layout, fmt: str) -> tuple[float, float]:
    """One dense layer's and one MoE layer's weights on one GPU."""
    params = count_params(model)
    linear, plain = FORMAT_BYTES[fmt], model.dtype_bytes
    tp = layout.tp
    attention = 0.0
    for name, count in _attention_parts(model).items():
        if name in ("kv_a", "q_a"):  # small down-projections vLLM replicates on every TP rank
            attention += count * linear
        elif name in ("k", "v") and tp > model.kv_heads:  # one whole KV head per rank
            attention += count / model.kv_heads * linear
        else:
            attention += count / tp * linear
    attention += (_attention_extras(model) + params.layer_norms) * plain
    dense_layer = attention + params.layer_dense_mlp / tp * linear
    ranks = layout.tp * layout.dp
    routed = math.ceil(params.routed / ranks) if layout.ep else params.routed / ranks
    shared = params.layer_shared / (1 if shared_experts_replicated(layout) else tp)
    moe_layer = (attention + routed * params.expert * linear + shared * linear + params.layer_router * plain)
    return dense_layer, moe_layer


def shared_experts_replicated(layout: Layout) -> bool:
    """config/parallel.py (use_sequence_parallel_moe): with EP, TP > 1 and DP > 1 vLLM builds the
    shared experts unsplit on every rank."""
    return layout.ep and layout.tp > 1 and layout.dp > 1


def weight_bytes_per_gpu(model: ModelShape, layout: Layout, fmt: str) -> int:
    """Weights on the fullest GPU: the largest pipeline stage, with embeddings or head."""
    params = count_params(model)
    plain, tp = model.dtype_bytes, layout.tp
    dense_layer, moe_layer = _layer_bytes(model, layout, fmt)
    per_stage = math.ceil(model.layers / layout.pp)
    # The fullest stage: MoE layers first (they are the heavier), then dense ones.
    moe_in_stage = min(per_stage, params.moe_layers)
    layers = moe_in_stage * moe_layer + (per_stage - moe_in_stage) * dense_layer
    vocab = (params.embed + params.lm_head) / tp * plain
    edges = vocab if layout.pp == 1 else max(params.embed, params.lm_head) / tp * plain
    return int(layers + edges + params.final_norm * plain)


def kv_bytes_per_token(model: ModelShape, layout: Layout, kv_dtype_bytes: int = 2, layers: int | None = None) -> int:
    """KV-cache bytes one token takes on one GPU of the fullest stage.

    Standard attention: 2 (K and V) x layers x KV heads x head_dim x dtype, heads split by TP but
    never below one per rank. MLA: one latent of kv_lora_rank + qk_rope_head_dim per layer, no
    factor 2, held whole by every TP rank.
    """
    if layers is None:
        layers = math.ceil(model.layers / layout.pp)
    if model.mla is not None:
        return layers * (model.mla.kv_lora_rank + model.mla.qk_rope_head_dim) * kv_dtype_bytes
    heads = max(1, model.kv_heads // layout.tp)
    return 2 * layers * heads * model.head_dim * kv_dtype_bytes


def reserve_bytes(model: ModelShape, layout: Layout, *, cuda: bool = True) -> int:
    """Activation peak of a prefill step of MAX_BATCHED_TOKENS, plus non-torch memory and (on
    a GPU) CUDA graphs. An estimate, stated as such in the plan."""
    inter = model.intermediate or 0
    if model.experts is not None:
        inter = max(inter, model.experts.intermediate * model.experts.top_k)
    per_token = (4 * model.hidden + 2 * inter // layout.tp) * model.dtype_bytes
    logits = 256 * model.vocab // layout.tp * 4  # fp32 logits of the sampled rows
    return MAX_BATCHED_TOKENS * per_token + logits + NON_TORCH_BYTES + (CUDA_GRAPH_BYTES if cuda else 0)


def gpu_memory(model: ModelShape, layout: Layout, fmt: str, gpu_bytes: int, utilization: float,
               *, cuda: bool = True, speculative: Speculative = NO_SPECULATION) -> GpuMemory:
    weights = weight_bytes_per_gpu(model, layout, fmt) + speculative.weight_bytes(model, layout, fmt)
    per_token = kv_bytes_per_token(model, layout) + speculative.kv_bytes_per_token(model, layout)
    return GpuMemory(weights=weights, kv_bytes_per_token=per_token,
                     reserve=reserve_bytes(model, layout, cuda=cuda),
                     budget=int(gpu_bytes * utilization))
