"""Pre-sharded weights in the real vLLM CPU engine (`--format sharded`): a tiny Llama
checkpoint written as TP=2 `sharded_state` rank files answers exactly as the original checkpoint
served at TP=2 with the default loader."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from installer.sharded_state import copy_side_files, write_rank
from tests.support.greedy import generate

LOGPROB_TOLERANCE = 1e-3
# Weights this large make the random model's answers depend sharply on every slice: swapping two
# KV heads of one layer moves its top log-probabilities by up to ~8 (at the usual 0.02, ~0.08).
WEIGHT_STD = 0.1
# The loader logs these when a saved tensor is narrower than its parameter or of another dtype:
# a file that loads only thanks to them does not have vLLM's layout.
LOADER_WARNINGS = ("loading tensor of shape", "Attempted to load weight")


def make_tiny_llama(target: Path, tokenizer_from: Path) -> Path:
    """A 4-layer Llama (hidden 256, 8 heads, 4 KV heads, head_dim 32) with the demo model's
    49,152-token vocabulary, tied embeddings like the demo model, and q/k/v/o and MLP biases so the
    biases' slicing is exercised too; every parameter random from a fixed seed, saved in bf16."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                         tie_word_embeddings=True, attention_bias=True, mlp_bias=True, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = WEIGHT_STD * torch.randn_like(parameter)
            parameter.copy_(1 + noise if name.endswith("norm.weight") else noise)
    model.to(torch.bfloat16).save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_from / name, target / name)
    return target


def test_sharded_tp2_answers_like_the_original_at_tp2(demo_model: Path, tmp_path: Path,
                                                       record_property: pytest.RecordProperty) -> None:
    original = make_tiny_llama(tmp_path / "tiny-llama", demo_model)
    sharded = tmp_path / "tiny-llama-tp2"
    rank_files = [path.name for rank in range(2) for path in write_rank(original, sharded, tp_size=2, rank=rank)]
    side_files = [path.name for path in copy_side_files(original, sharded)]
    assert rank_files == ["model-rank-0-part-0.safetensors", "model-rank-1-part-0.safetensors"]
    assert sorted(p.name for p in sharded.iterdir()) == sorted(rank_files + side_files)

    # Both engines at once: their start-up is mostly single-threaded, so this saves about a minute.
    with ThreadPoolExecutor(max_workers=2) as pool:
        reference = pool.submit(generate, original, tmp_path, "auto")
        answered, log = pool.submit(generate, sharded, tmp_path, "sharded_state", load_format="sharded_state").result()
        expected, _ = reference.result()

    assert "sharded_state_loader.py" in log, "the sharded engine did not use the sharded_state loader"
    for warning in LOADER_WARNINGS:
        assert warning not in log, f"vLLM adapted a tensor while loading: {warning!r}"
    largest = 0.0
    for want, got in zip(expected, answered, strict=True):
        assert got["tokens"] == want["tokens"], f"greedy tokens differ for {want['prompt']!r}"
        for step, (want_top, got_top) in enumerate(zip(want["logprobs"], got["logprobs"], strict=True)):
            chosen = str(want["tokens"][step])
            assert chosen in got_top
            for token in want_top.keys() & got_top.keys():
                largest = max(largest, abs(want_top[token] - got_top[token]))
    record_property("sharded_tp2_max_logprob_difference", largest)
    print(f"sharded_state TP=2 vs original TP=2: identical greedy tokens, largest top-logprob difference {largest:g}")
    assert largest <= LOGPROB_TOLERANCE
