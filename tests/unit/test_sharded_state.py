"""Pre-sharding into vLLM's sharded_state layout (`--format sharded`), without vLLM:
the names and shapes of each rank's tensors, their values against the source, and the refusals.
tests/integration/test_sharded_state.py proves vLLM loads the result and answers the same."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from installer.model_config import ModelShape, load_model_config
from installer.sharded_state import SUPPORTED_ARCHITECTURES, ShardingError, copy_side_files, read_config, write_rank

# vocab 1000 pads to 1024: at TP=2 rank 1 holds rows 512..999 and 24 zero rows.
SMALL = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
         "tie_word_embeddings": False}
SCALES = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")


def make_checkpoint(target: Path, family: str = "llama", **overrides: object) -> dict[str, torch.Tensor]:
    """A tiny transformers checkpoint with every parameter random (biases and norms too);
    returns its tensors as saved."""
    torch.manual_seed(0)
    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                                 "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[family]
    model = model_class(config_class(**(SMALL | overrides)))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn_like(parameter))
    model.to(torch.bfloat16).save_pretrained(target)
    (target / "tokenizer.json").write_text("{}")
    return load_file(target / "model.safetensors")


def rank_state(out: Path, rank: int) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in sorted(out.glob(f"model-rank-{rank}-part-*.safetensors")):
        state |= load_file(path)
    return state


def shard(model: Path, out: Path, tp: int, **kwargs: int) -> list[dict[str, torch.Tensor]]:
    for rank in range(tp):
        write_rank(model, out, tp_size=tp, rank=rank, **kwargs)
    return [rank_state(out, rank) for rank in range(tp)]


@pytest.mark.parametrize("architecture", SUPPORTED_ARCHITECTURES)
def test_every_supported_architecture_is_read_and_sharded(tmp_path: Path, architecture: str) -> None:
    family = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}[architecture]
    source = make_checkpoint(tmp_path / "m", family)
    config = read_config(tmp_path / "m")
    assert config.architecture == architecture and config.layers == 2 and config.head_dim == 16
    ranks = shard(tmp_path / "m", tmp_path / "out", 2)
    for state in ranks:  # every layer's fused projections on every rank, half the heads each
        for i in range(2):
            assert list(state[f"model.layers.{i}.self_attn.qkv_proj.weight"].shape) == [(2 + 1 + 1) * 16, 64]
            assert list(state[f"model.layers.{i}.mlp.gate_up_proj.weight"].shape) == [128, 64]
    # The ranks' unsplit tensors are the source's.
    assert all(torch.equal(state["model.norm.weight"], source["model.norm.weight"]) for state in ranks)


def test_llama_tp2_names_and_shapes(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "m", attention_bias=True, mlp_bias=True)
    ranks = shard(tmp_path / "m", tmp_path / "out", 2)
    layer = {"input_layernorm.weight": [64], "post_attention_layernorm.weight": [64],
             "self_attn.qkv_proj.weight": [(2 + 1 + 1) * 16, 64], "self_attn.qkv_proj.bias": [64],
             "self_attn.o_proj.weight": [64, 32], "self_attn.o_proj.bias": [64],
             "mlp.gate_up_proj.weight": [128, 64], "mlp.gate_up_proj.bias": [128],
             "mlp.down_proj.weight": [64, 64], "mlp.down_proj.bias": [64]} | {f"self_attn.attn.{s}": [] for s in SCALES}
    expected = {"model.embed_tokens.weight": [512, 64], "model.norm.weight": [64], "lm_head.weight": [512, 64]}
    expected |= {f"model.layers.{i}.{name}": shape for i in range(2) for name, shape in layer.items()}
    for state in ranks:
        assert {name: list(tensor.shape) for name, tensor in state.items()} == expected
        assert all(state[name].dtype == torch.bfloat16 for name in expected if "_scale" not in name)


def test_values_come_from_the_right_slices(tmp_path: Path) -> None:
    source = make_checkpoint(tmp_path / "m", attention_bias=True, mlp_bias=True)
    ranks = shard(tmp_path / "m", tmp_path / "out", 2)
    p = "model.layers.1."
    for rank, state in enumerate(ranks):
        q, k, v = state[p + "self_attn.qkv_proj.weight"].split([32, 16, 16])
        assert torch.equal(q, source[p + "self_attn.q_proj.weight"][rank * 32:(rank + 1) * 32])
        assert torch.equal(k, source[p + "self_attn.k_proj.weight"][rank * 16:(rank + 1) * 16])
        assert torch.equal(v, source[p + "self_attn.v_proj.weight"][rank * 16:(rank + 1) * 16])
        gate, up = state[p + "mlp.gate_up_proj.bias"].split(64)
        assert torch.equal(gate, source[p + "mlp.gate_proj.bias"][rank * 64:(rank + 1) * 64])
        assert torch.equal(up, source[p + "mlp.up_proj.bias"][rank * 64:(rank + 1) * 64])
        # Row-parallel: this rank's input columns; the bias is whole on every rank.
        o_proj, down_proj = source[p + "self_attn.o_proj.weight"], source[p + "mlp.down_proj.weight"]
        assert torch.equal(state[p + "self_attn.o_proj.weight"], o_proj[:, rank * 32:(rank + 1) * 32])
        assert torch.equal(state[p + "mlp.down_proj.weight"], down_proj[:, rank * 64:(rank + 1) * 64])
        assert torch.equal(state[p + "mlp.down_proj.bias"], source[p + "mlp.down_proj.bias"])
        assert torch.equal(state[p + "input_layernorm.weight"], source[p + "input_layernorm.weight"])
        for scale in SCALES:
            assert state[p + f"self_attn.attn.{scale}"].dtype == torch.float32
            assert state[p + f"self_attn.attn.{scale}"].item() == 1.0


def test_vocab_is_padded_to_64_then_split_with_zero_rows(tmp_path: Path) -> None:
    source = make_checkpoint(tmp_path / "m")
    first, second = shard(tmp_path / "m", tmp_path / "out", 2)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(first[name], source[name][:512])
        assert torch.equal(second[name][:488], source[name][512:])
        assert not second[name][488:].any()


def test_kv_heads_are_replicated_when_tp_exceeds_them(tmp_path: Path) -> None:
    """4 query heads, 2 KV heads, TP=4: rank r has query head r and KV head r // 2."""
    source = make_checkpoint(tmp_path / "m", attention_bias=True)
    p = "model.layers.0.self_attn."
    for rank, state in enumerate(shard(tmp_path / "m", tmp_path / "out", 4)):
        kv_head = rank // 2
        for kind in ("weight", "bias"):
            q, k, v = state[p + f"qkv_proj.{kind}"].split([16, 16, 16])
            assert torch.equal(q, source[p + f"q_proj.{kind}"][rank * 16:(rank + 1) * 16])
            assert torch.equal(k, source[p + f"k_proj.{kind}"][kv_head * 16:(kv_head + 1) * 16])
            assert torch.equal(v, source[p + f"v_proj.{kind}"][kv_head * 16:(kv_head + 1) * 16])
        assert list(state["lm_head.weight"].shape) == [256, 64]


def test_tied_embeddings_are_one_tensor_named_lm_head(tmp_path: Path) -> None:
    source = make_checkpoint(tmp_path / "m", tie_word_embeddings=True)
    assert "lm_head.weight" not in source
    for rank, state in enumerate(shard(tmp_path / "m", tmp_path / "out", 2)):
        assert "model.embed_tokens.weight" not in state
        rows = source["model.embed_tokens.weight"][rank * 512:(rank + 1) * 512]
        assert torch.equal(state["lm_head.weight"][:len(rows)], rows)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_sharders_config_is_the_planners_model_shape_read_as_vllm_reads_it(tmp_path: Path, family: str) -> None:
    # ModelShape declares the fields once: the sharder's config is one, with only what vLLM's
    # classes read per family differing, so a field added to the shape needs no second list.
    make_checkpoint(tmp_path / "m", family)
    shape, config = load_model_config(tmp_path / "m"), read_config(tmp_path / "m")
    assert isinstance(config, ModelShape)
    per_family = {"head_dim", "qkv_bias", "qk_norm"}
    assert {field.name: getattr(config, field.name) for field in fields(ModelShape) if field.name not in per_family} \
        == {field.name: getattr(shape, field.name) for field in fields(ModelShape) if field.name not in per_family}
    assert config.tensor_dtype == {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}[shape.dtype]


def test_qwen2_has_qkv_bias_and_qwen3_has_qk_norm(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "q2", "qwen2")
    rewrite_config(tmp_path / "q2", head_dim=None)  # as transformers writes it when the config has none
    qwen2 = shard(tmp_path / "q2", tmp_path / "q2-out", 2)[0]
    assert "model.layers.0.self_attn.qkv_proj.bias" in qwen2
    assert "model.layers.0.self_attn.o_proj.bias" not in qwen2
    source = make_checkpoint(tmp_path / "q3", "qwen3")
    qwen3 = shard(tmp_path / "q3", tmp_path / "q3-out", 2)[1]
    assert "model.layers.0.self_attn.qkv_proj.bias" not in qwen3
    for norm in ("q_norm", "k_norm"):
        name = f"model.layers.0.self_attn.{norm}.weight"
        assert torch.equal(qwen3[name], source[name])


def test_parts_stay_under_the_limit_and_stale_parts_go(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "m")
    whole = shard(tmp_path / "m", tmp_path / "one", 2)[1]
    reported: list[int] = []
    paths = write_rank(tmp_path / "m", tmp_path / "out", tp_size=2, rank=1, max_part_bytes=40_000,
                       progress=reported.append)
    assert sum(reported) == sum(tensor.nbytes for tensor in whole.values())
    assert [p.name for p in paths] == [f"model-rank-1-part-{i}.safetensors" for i in range(len(paths))]
    assert len(paths) > 3
    largest = 512 * 64 * 2  # a vocab shard
    for path in paths:
        with safe_open(path, framework="pt") as handle:
            sizes = [handle.get_slice(name).get_shape() for name in handle.keys()]
        assert len(sizes) == 1 or sum(2 * torch.Size(s).numel() for s in sizes) <= 40_000 + largest
    assert rank_state(tmp_path / "out", 1).keys() == whole.keys()
    again = write_rank(tmp_path / "m", tmp_path / "out", tp_size=2, rank=1)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [again[0].name]


def test_side_files_are_everything_but_weights_index_and_manifest(tmp_path: Path) -> None:
    model = tmp_path / "m"
    make_checkpoint(model)
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    (model / "manifest.json").write_text("{}")
    (model / "chat_template.jinja").write_text("{{ messages }}")
    (model / "original").mkdir()
    copies = copy_side_files(model, tmp_path / "out")
    assert sorted(p.name for p in copies) == ["chat_template.jinja", "config.json", "generation_config.json",
                                              "tokenizer.json"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(p.name for p in copies)
    assert (tmp_path / "out" / "config.json").read_bytes() == (model / "config.json").read_bytes()


def expect_refusal(model: Path, out: Path, *needles: str, tp: int = 2, rank: int = 0) -> None:
    with pytest.raises(ShardingError) as caught:
        write_rank(model, out, tp_size=tp, rank=rank)
    for needle in needles:
        assert needle in caught.value.message
    assert not out.exists(), "nothing may be written before the checks pass"


def rewrite_config(model: Path, **changes: object) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | changes))


def test_refuses_unsupported_architectures(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "m")
    rewrite_config(tmp_path / "m", architectures=["Qwen3MoeForCausalLM"])
    expect_refusal(tmp_path / "m", tmp_path / "out", str(tmp_path / "m" / "config.json"), "Qwen3MoeForCausalLM")


def test_refuses_quantized_checkpoints(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "m")
    rewrite_config(tmp_path / "m", quantization_config={"quant_method": "fp8"})
    expect_refusal(tmp_path / "m", tmp_path / "out", "config.json", "quantization_config")


@pytest.mark.parametrize(("tp", "field"), [(3, "num_attention_heads"), (8, "num_attention_heads")])
def test_refuses_a_tp_size_that_does_not_divide_the_heads(tmp_path: Path, tp: int, field: str) -> None:
    make_checkpoint(tmp_path / "m")
    expect_refusal(tmp_path / "m", tmp_path / "out", "config.json", field, f"size {tp}", tp=tp)


def test_refuses_a_tp_size_that_does_not_divide_the_padded_vocab(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "m", num_attention_heads=6, num_key_value_heads=3, hidden_size=96, intermediate_size=96)
    expect_refusal(tmp_path / "m", tmp_path / "out", "config.json", "vocab_size 1000 padded to 1024", tp=3)


def test_refuses_a_rank_outside_the_tp_size(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "m")
    expect_refusal(tmp_path / "m", tmp_path / "out", "rank 2", rank=2)


def test_refuses_a_missing_tensor(tmp_path: Path) -> None:
    tensors = make_checkpoint(tmp_path / "m")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "m" / "model.safetensors")
    expect_refusal(tmp_path / "m", tmp_path / "out", str(tmp_path / "m"), "model.layers.1.mlp.up_proj.weight",
                   "missing")


def test_refuses_a_shape_that_disagrees_with_the_config(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "m")
    rewrite_config(tmp_path / "m", intermediate_size=256)
    expect_refusal(tmp_path / "m", tmp_path / "out", str(tmp_path / "m" / "model.safetensors"),
                   "model.layers.0.mlp.gate_proj.weight", "[128, 64]", "[256, 64]")


def test_refuses_a_dtype_that_disagrees_with_the_config(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "m")
    rewrite_config(tmp_path / "m", dtype="float16")
    expect_refusal(tmp_path / "m", tmp_path / "out", "model.safetensors", "model.embed_tokens.weight", "BF16")


def test_refuses_a_tensor_vllm_has_no_parameter_for(tmp_path: Path) -> None:
    tensors = make_checkpoint(tmp_path / "m")
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64, dtype=torch.bfloat16)
    save_file(tensors, tmp_path / "m" / "model.safetensors")
    expect_refusal(tmp_path / "m", tmp_path / "out", "model.safetensors", "model.layers.0.self_attn.o_proj.bias")


def test_refuses_a_truncated_file(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    expect_refusal(tmp_path / "m", tmp_path / "out", str(weights), "not a readable safetensors file")


def test_refuses_an_index_naming_a_missing_file(tmp_path: Path) -> None:
    tensors = make_checkpoint(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").rename(tmp_path / "m" / "model-00001-of-00002.safetensors")
    weight_map = {name: "model-00001-of-00002.safetensors" for name in tensors}
    weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    expect_refusal(tmp_path / "m", tmp_path / "out", "model.safetensors.index.json", "model.norm.weight",
                   "model-00002-of-00002.safetensors")


def test_refuses_to_write_into_the_checkpoint(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "m")
    with pytest.raises(ShardingError, match="the checkpoint itself"):
        write_rank(tmp_path / "m", tmp_path / "m", tp_size=1, rank=0)
