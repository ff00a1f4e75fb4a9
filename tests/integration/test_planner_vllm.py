"""The planner's KV capacity against what the real vLLM CPU engine reports at start-up:
the demo model here, on the session's engine; a tiny MoE at TP=2 with and without expert
parallelism and at DP=2 here, on engines of its own; a tiny MoE at TP=1 on the engine the bundle test
(test_bundle_install.py) starts from the bundle, which carries it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from appliance.engine_launch import resolve_device, resolve_dtype
from appliance.settings import load_settings
from installer.layout_rules import Site, rule_out
from installer.memory import GIB, Layout, kv_bytes_per_token
from installer.model_config import DTYPE_BYTES, load_model_config
from tests.integration.conftest import Running
from tests.support.greedy import (
    CPU_BLOCK_TOKENS,
    KV_SIZE,
    PROMPTS,
    generate,
    held_in_blocks,
    kv_tokens_at_start,
    reported_kv,
)
from tests.support.models import tiny_moe


def test_predicted_kv_capacity_matches_vllm(running: Running, record_property: pytest.RecordProperty) -> None:
    home = running.appliance.home
    settings = load_settings(home.settings_file, environ=running.appliance.env)
    reported, request_tokens = reported_kv((home.logs / "vllm-main.log").read_text())
    # The CPU engine's KV budget is fixed (engine.cpu_kvcache_gib), so the capacity is that
    # budget over the bytes one token takes, in the engine's dtype (float32 on the CPU engine).
    kv_bytes = DTYPE_BYTES[resolve_dtype(settings.engine, resolve_device(settings.engine))]
    predicted = settings.engine.cpu_kvcache_gib * GIB // kv_bytes_per_token(load_model_config(home.demo_model),
                                                                             Layout(), kv_bytes)
    difference = predicted / reported - 1
    record_property("kv_capacity", {"predicted": predicted, "vllm": reported, "difference": difference})
    print(f"KV capacity: planner {predicted:,} tokens, vLLM {reported:,} tokens ({difference:+.2%})")
    # The demo model's 46,080 bytes a token (float32) do not divide the budget into whole blocks:
    # vLLM holds the whole blocks of what the planner predicts, fewer than a block's tokens less.
    assert reported == held_in_blocks(predicted, request_tokens), (predicted, reported, request_tokens)
    assert 0 <= predicted - reported < CPU_BLOCK_TOKENS


def test_a_tiny_moe_at_tp2_and_dp2_holds_the_kv_the_planner_predicts(
        demo_model: Path, tmp_path: Path, record_property: pytest.RecordProperty) -> None:
    """The layouts of an MoE this machine can start (TP=2 with the experts sliced or whole per rank,
    DP=2; one core a rank) pass the planner's rules, start in the real vLLM CPU engine, and hold the
    KV tokens the memory model predicts from the engine's fixed KV budget a rank. TP=2 also answers;
    the CPU build cannot run an MoE's forward pass with EP (a worker dies, SIGSEGV) or DP (its CPU
    communicator has no all_gatherv for the experts' dispatch), so those are only started."""
    model = tiny_moe(tmp_path / "tiny-moe", demo_model)
    shape = load_model_config(model)
    layouts = {"tp2": Layout(tp=2), "tp2-ep": Layout(tp=2, ep=True), "dp2": Layout(dp=2)}
    for layout in layouts.values():
        assert rule_out(shape, layout, Site(gpus_per_host=2, nvlink_reach=2)) is None, layout
    # The engines at once: their start-up is mostly single-threaded.
    with ThreadPoolExecutor(max_workers=3) as pool:
        answering = pool.submit(generate, model, tmp_path, "tp2")
        starting = pool.submit(generate, model, tmp_path, "tp2-ep", expert_parallel=True, prompts=())
        replicas = pool.submit(kv_tokens_at_start, model, tmp_path, "dp2", dp=2)
        answers, tp2_log = answering.result()
        ep_log = starting.result()[1]
        dp2_tokens = replicas.result()
    assert [len(answer["tokens"]) for answer in answers] == [16] * len(PROMPTS)
    assert "'enable_expert_parallel': True" in ep_log  # vLLM's own list of the arguments it took
    reported = {"tp2": _tokens(tp2_log), "tp2-ep": _tokens(ep_log), "dp2": sum(dp2_tokens)}
    for name, layout in layouts.items():
        # VLLM_CPU_KVCACHE_SPACE is 1 GiB a rank; a replica's tokens times the replicas.
        predicted = 1 * GIB // kv_bytes_per_token(shape, layout, DTYPE_BYTES["bfloat16"]) * layout.dp
        difference = predicted / reported[name] - 1
        record_property(f"kv_capacity_{name}", {"predicted": predicted, "vllm": reported[name],
                                                "difference": difference})
        print(f"tiny MoE {layout}: planner {predicted:,} KV tokens, vLLM {reported[name]:,} ({difference:+.2%})")
        # 1 GiB over 512 bytes a token (TP=2: one KV head a rank) or 1,024 (a DP replica) is whole
        # blocks of 128 tokens, so vLLM's paging rounds nothing off: the capacities are equal.
        assert reported[name] == predicted, (name, predicted, reported[name])


def _tokens(log: str) -> int:
    return int(KV_SIZE.findall(log)[-1].replace(",", ""))
