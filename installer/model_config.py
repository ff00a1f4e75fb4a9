"""A model's shape, read from its Hugging Face `config.json` alone (no weights): what the memory
model and the planner need, for dense/GQA, MoE and MLA architectures."""

from __future__ import annotations

import builtins
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.errors import ApplianceError
from appliance.records import config_sha256, read_regular_file

DENSE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
MOE = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
MLA = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")  # Kimi-K2 ships as DeepseekV3ForCausalLM
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
CONFIG_MAX_BYTES = 1 << 20  # published config.json files are KiB (tens of KiB with long quantization lists)
FIELD_MAX = 2**40  # no count or size in a config is near it; far larger ones overflow the memory model's floats


class ModelConfigError(ApplianceError):
    """A config.json the planner cannot use."""


@dataclass(frozen=True)
class Mla:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class Experts:
    routed: int
    shared: int
    top_k: int
    intermediate: int  # per expert
    moe_layers: int  # layers whose MLP is the expert block; the others are dense


@dataclass(frozen=True)
class ModelShape:
    name: str
    architecture: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP (0 when every layer is MoE)
    vocab: int
    tied_embeddings: bool
    dtype: str  # bfloat16, float16 or float32
    qkv_bias: bool
    qk_norm: bool
    mla: Mla | None
    experts: Experts | None
    quantization: dict[str, Any] | None  # the checkpoint's own quantization_config
    config_sha256: str  # identifies the config a plan was made for
    mtp_layers: int = 0  # DeepSeek's multi-token-prediction modules (num_nextn_predict_layers)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def is_moe(self) -> bool:
        return self.experts is not None


def read_config_file(file: Path, error: type[ApplianceError], *, hint: str) -> dict[str, Any]:
    """The JSON object in a config.json; else `error`, naming the file and what is wrong."""
    try:
        data = read_regular_file(file, CONFIG_MAX_BYTES)
    except FileNotFoundError:
        raise error(f"{file}: no such file", hint=hint) from None
    except OSError as exc:
        raise error(f"{file}: cannot read the config: {exc.strerror or exc}") from exc
    try:
        config = json.loads(data)
    except ValueError as exc:  # not UTF-8, or not JSON
        raise error(f"{file}: not a readable JSON config: {exc}") from exc
    except RecursionError:
        raise error(f"{file}: not a readable JSON config: nested too deeply") from None
    if not isinstance(config, dict):
        raise error(f"{file}: not a JSON object")
    return config


def load_model_config(path: Path) -> ModelShape:
    """The shape of the model at `path`: a checkpoint directory or a bare config.json."""
    try:
        directory = path.is_dir()
    except OSError as exc:  # a name too long, a permission denied on the way
        raise ModelConfigError(f"{path}: cannot read the model: {exc.strerror or exc}") from exc
    file = path / "config.json" if directory else path
    config = read_config_file(file, ModelConfigError, hint="give a checkpoint directory or its config.json")
    name = path.name if directory else path.stem
    return parse_config(config, name=name, source=str(file))


def parse_config(config: dict[str, Any], *, name: str, source: str) -> ModelShape:
    fields = _Fields(config, source)
    architectures = config.get("architectures") or []
    architecture = architectures[0] if isinstance(architectures, list) and architectures else None
    if architecture not in DENSE + MOE + MLA:
        raise ModelConfigError(
            f"{source}: architectures: {architecture!r} is not one the planner models",
            hint=f"supported: {', '.join(DENSE + MOE + MLA)}")
    layers, hidden, heads = (fields.int("num_hidden_layers"), fields.int("hidden_size"),
                             fields.int("num_attention_heads"))
    kv_heads = fields.int("num_key_value_heads", default=heads)
    mla = experts = None
    if architecture in MLA:
        mla = Mla(q_lora_rank=fields.optional_int("q_lora_rank"), kv_lora_rank=fields.int("kv_lora_rank"),
                  qk_nope_head_dim=fields.int("qk_nope_head_dim"), qk_rope_head_dim=fields.int("qk_rope_head_dim"),
                  v_head_dim=fields.int("v_head_dim"))
        routed = fields.int("n_routed_experts", default=0, minimum=0)
        if routed:
            dense_layers = fields.int("first_k_dense_replace", default=0, minimum=0)
            if dense_layers > layers:
                raise ModelConfigError(f"{source}: first_k_dense_replace: {dense_layers} is more than "
                                       f"num_hidden_layers ({layers})")
            experts = Experts(routed=routed, shared=fields.int("n_shared_experts", default=0, minimum=0),
                              top_k=fields.int("num_experts_per_tok"), intermediate=fields.int("moe_intermediate_size"),
                              moe_layers=layers - dense_layers)
    elif architecture in MOE:
        # Qwen's own configs say num_experts; Mixtral's, and transformers 5's for both, num_local_experts.
        routed = fields.int("num_experts" if "num_experts" in config else "num_local_experts")
        dense_only = fields.layer_list("mlp_only_layers", layers)
        experts = Experts(routed=routed, shared=1 if config.get("shared_expert_intermediate_size") else 0,
                          top_k=fields.int("num_experts_per_tok"),
                          intermediate=(fields.int("intermediate_size") if architecture == "MixtralForCausalLM"
                                        else fields.int("moe_intermediate_size")),
                          moe_layers=layers - len(dense_only))
    if experts is not None and not 0 < experts.top_k <= experts.routed:
        raise ModelConfigError(f"{source}: num_experts_per_tok: {experts.top_k} must be between 1 and "
                               f"the number of experts ({experts.routed})")
    head_dim = fields.int("head_dim", default=hidden // heads)
    if heads % kv_heads:
        raise ModelConfigError(f"{source}: num_key_value_heads: {kv_heads} does not divide "
                               f"num_attention_heads {heads}")
    dense_needed = experts is None or experts.moe_layers < layers
    dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise ModelConfigError(f"{source}: torch_dtype: {_shown(dtype)} is not one of {', '.join(DTYPE_BYTES)}")
    quantization = config.get("quantization_config")
    if quantization is not None and not isinstance(quantization, dict):
        raise ModelConfigError(f"{source}: quantization_config: not an object")
    if quantization is not None:
        _check_block_size(quantization.get("weight_block_size"), source)
    return ModelShape(
        name=name, architecture=architecture, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, intermediate=fields.int("intermediate_size") if dense_needed else 0,
        vocab=fields.int("vocab_size"), tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        dtype=dtype, qkv_bias=architecture == "Qwen2ForCausalLM" or bool(config.get("attention_bias")),
        qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"), mla=mla, experts=experts,
        quantization=quantization,
        config_sha256=config_sha256(config),
        mtp_layers=fields.int("num_nextn_predict_layers", default=0, minimum=0) if architecture in MLA else 0)


def _check_block_size(sizes: Any, source: str) -> None:
    """quantization_config.weight_block_size: absent, or the FP8 block's 1 or 2 dimensions."""
    if sizes is None:
        return
    if (not isinstance(sizes, list) or not 1 <= len(sizes) <= 2
            or not all(type(size) is int and 1 <= size <= FIELD_MAX for size in sizes)):
        raise ModelConfigError(f"{source}: quantization_config.weight_block_size: {_shown(sizes)} is not a list "
                               "of 1 or 2 positive integers")


def _shown(value: Any) -> str:
    """A config value for an error message, cut short when it is long (a list of a million items)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


class _Fields:
    """Typed reads of config fields with errors that name the file and the field."""

    def __init__(self, config: dict[str, Any], source: str) -> None:
        self.config = config
        self.source = source

    def int(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        value = self.config.get(key)
        if value is None:  # absent, or null as transformers writes unset fields
            value = default
        if value is None:
            raise ModelConfigError(f"{self.source}: {key}: missing (needed to size the model)")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ModelConfigError(f"{self.source}: {key}: {_shown(value)} is not an integer >= {minimum}")
        if value > FIELD_MAX:
            raise ModelConfigError(f"{self.source}: {key}: {_shown(value)} is more than {FIELD_MAX}")
        return value

    def layer_list(self, key: str, layers: builtins.int) -> list[builtins.int]:
        """Distinct layer indexes below `layers`; an absent or null field is no layers."""
        value = self.config.get(key)
        if value is None:
            return []
        if (not isinstance(value, list) or not all(type(item) is builtins.int and 0 <= item < layers for item in value)
                or len(set(value)) != len(value)):
            raise ModelConfigError(f"{self.source}: {key}: {_shown(value)} is not a list of distinct layer "
                                   f"indexes from 0 to {layers - 1}")
        return value

    def optional_int(self, key: str) -> builtins.int | None:  # `int` in this class is the method above
        return None if self.config.get(key) is None else self.int(key)
