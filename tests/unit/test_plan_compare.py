"""The arithmetic checks bench/plan_compare.py sets beside each planner's answer: KV bytes per token
per rank (standard attention and MLA), weights on the fullest GPU, sequences, and the 5 % flag.
Pure functions: no planner, no peer venv."""

from __future__ import annotations

import math

import pytest

from bench.plan_compare import (
    ParamCounts,
    Shards,
    compared,
    deviation,
    kv_bytes_per_token_per_rank,
    sequences,
    weight_bytes_per_gpu,
)

LLAMA_405B = {"num_hidden_layers": 126, "hidden_size": 16384, "num_attention_heads": 128, "num_key_value_heads": 8}
QWEN3_235B = {"num_hidden_layers": 94, "hidden_size": 4096, "num_attention_heads": 64, "num_key_value_heads": 4,
              "head_dim": 128}
DEEPSEEK_V3 = {"num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128, "num_key_value_heads": 128,
               "kv_lora_rank": 512, "qk_rope_head_dim": 64}


@pytest.mark.parametrize("config,shards,expected", [
    (LLAMA_405B, Shards(1, 1), 2 * 126 * 8 * 128 * 2),  # head_dim from hidden / heads
    (LLAMA_405B, Shards(8, 1), 2 * 126 * 1 * 128 * 2),
    (LLAMA_405B, Shards(8, 2), 2 * 63 * 1 * 128 * 2),
    (QWEN3_235B, Shards(4, 1), 2 * 94 * 1 * 128 * 2),
    (QWEN3_235B, Shards(8, 1), 2 * 94 * 1 * 128 * 2),  # 4 KV heads over 8 ranks: one whole head each
    (DEEPSEEK_V3, Shards(1, 1), 61 * 576 * 2),  # MLA: one latent per layer, no factor 2
    (DEEPSEEK_V3, Shards(8, 1), 61 * 576 * 2),  # every TP rank holds the whole latent
    (DEEPSEEK_V3, Shards(1, 8), 8 * 576 * 2),  # PP: the fullest stage's ceil(61 / 8) layers
])
def test_kv_bytes_per_token_per_rank(config: dict[str, int], shards: Shards, expected: int) -> None:
    assert kv_bytes_per_token_per_rank(config, shards) == expected


DENSE = ParamCounts(embed=100, lm_head=100, dense_layer=1000, moe_layer=0, moe_experts=0, dense_layers=10,
                    moe_layers=0)
MOE = ParamCounts(embed=100, lm_head=50, dense_layer=1000, moe_layer=8000, moe_experts=7200, dense_layers=2,
                  moe_layers=6)


def test_weights_without_pipeline_are_everything_over_tp() -> None:
    assert weight_bytes_per_gpu(DENSE, Shards(4, 1), linear_bytes=2) == (10 * 1000 + 200) * 2 / 4


def test_weights_under_pipeline_are_the_fullest_stage() -> None:
    # 10 layers over PP 3: 4 on the fullest stage, with the larger of the embedding and the head.
    assert weight_bytes_per_gpu(DENSE, Shards(2, 3), linear_bytes=2) == (4 * 1000 + 100) * 2 / 2
    # MoE layers fill the fullest stage first: 4 of the 6, and no dense one.
    assert weight_bytes_per_gpu(MOE, Shards(1, 2), linear_bytes=1) == 4 * 8000 * 1 + 100 * 2


def test_weights_keep_embedding_and_head_in_16_bits_and_spread_experts_over_dp_under_ep() -> None:
    fp8 = weight_bytes_per_gpu(MOE, Shards(2, 1, dp=2, ep=False), linear_bytes=1)
    assert fp8 == (2 * 1000 + 6 * 8000 + 150 * 2) / 2
    ep = weight_bytes_per_gpu(MOE, Shards(2, 1, dp=2, ep=True), linear_bytes=1)
    assert ep == (2 * 1000 + 6 * (800 + 7200 / 2) + 150 * 2) / 2


def test_sequences_are_whole_sequences_per_replica() -> None:
    assert sequences(free_kv_bytes_per_gpu=10 * 1000 * 100 - 1, kv_per_token=100, context=1000, dp=1) == 9
    assert sequences(free_kv_bytes_per_gpu=10 * 1000 * 100, kv_per_token=100, context=1000, dp=3) == 30
    assert sequences(free_kv_bytes_per_gpu=0, kv_per_token=100, context=1000, dp=2) == 0


def test_deviation_and_the_five_percent_flag() -> None:
    assert deviation(105, 100) == pytest.approx(0.05)
    assert deviation(0, 0) == 0.0
    assert deviation(4, 0) == math.inf
    assert not compared(105, 100)["flag"]
    assert compared(106, 100)["flag"] and compared(94, 100)["flag"]
    within = compared(8784, 9216)  # -4.7 %
    assert within["deviation"] == pytest.approx(-0.0469, abs=1e-4) and not within["flag"]
    infinite = compared(4, 0)  # a planner's 4 sequences where none fit
    assert infinite["flag"] and infinite["deviation"] is None
    assert compared(None, 100) == {"answer": None, "check": 100, "deviation": None, "flag": False}
