"""The planner's KV capacity against what the real vLLM CPU engine reports at start-up:
the demo model here, on the session's engine; a tiny MoE at TP=2 with and without expert
parallelism here, on engines of its own; a tiny MoE at TP=1 on the engine the bundle test
(test_bundle_install.py) starts from the bundle, which carries it."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from appliance.engine_launch import resolve_device, resolve_dtype
from appliance.settings import load_settings
from installer.layout_rules import Site, rule_out
from installer.memory import GIB, Layout, kv_bytes_per_token
from installer.model_config import DTYPE_BYTES, load_model_config
from tests.integration.conftest import Running
from tests.support.greedy import PROMPTS, generate
from tests.support.models import tiny_moe


def test_predicted_kv_capacity_matches_vllm(running: Running, record_property: pytest.RecordProperty) -> None:
    home = running.appliance.home
    settings = load_settings(home.settings_file, environ=running.appliance.env)
    log = (home.logs / "vllm-main.log").read_text()
    reported = int(re.findall(r"KV cache size: ([\d,]+) tokens", log)[-1].replace(",", ""))
    # The CPU engine's KV budget is fixed (engine.cpu_kvcache_gib), so the capacity is that
    # budget over the bytes one token takes, in the engine's dtype (float32 on the CPU engine).
    kv_bytes = DTYPE_BYTES[resolve_dtype(settings.engine, resolve_device(settings.engine))]
    predicted = settings.engine.cpu_kvcache_gib * GIB // kv_bytes_per_token(load_model_config(home.demo_model),
                                                                             Layout(), kv_bytes)
    difference = predicted / reported - 1
    record_property("kv_capacity", {"predicted": predicted, "vllm": reported, "difference": difference})
    print(f"KV capacity: planner {predicted:,} tokens, vLLM {reported:,} tokens ({difference:+.2%})")
    assert abs(difference) < 0.10


def test_a_tiny_moe_at_tp2_with_and_without_ep_holds_the_kv_the_planner_predicts(
        demo_model: Path, tmp_path: Path, record_property: pytest.RecordProperty) -> None:
    """The layouts of an MoE this machine can start (TP=2, experts sliced or whole per rank, one core
    each) pass the planner's rules, start in the real vLLM CPU engine (TP=2 also answers), and hold
    the KV tokens the memory model predicts from the engine's fixed KV budget a rank."""
    model = tiny_moe(tmp_path / "tiny-moe", demo_model)
    shape = load_model_config(model)
    layouts = {"tp2": Layout(tp=2), "tp2-ep": Layout(tp=2, ep=True)}
    for layout in layouts.values():
        assert rule_out(shape, layout, Site(gpus_per_host=2, nvlink_reach=2)) is None, layout
    # Both engines at once: their start-up is mostly single-threaded. With EP the CPU build starts
    # and sizes its KV cache, then a worker dies (SIGSEGV) in the first forward pass: it answers nothing.
    with ThreadPoolExecutor(max_workers=2) as pool:
        started = {name: pool.submit(generate, model, tmp_path, name, expert_parallel=layout.ep,
                                     prompts=() if layout.ep else PROMPTS)
                   for name, layout in layouts.items()}
        results = {name: future.result() for name, future in started.items()}
    logs = {name: log for name, (_, log) in results.items()}
    assert [len(answer["tokens"]) for answer in results["tp2"][0]] == [16] * len(PROMPTS)
    for name, layout in layouts.items():
        reported = int(re.findall(r"KV cache size: ([\d,]+) tokens", logs[name])[-1].replace(",", ""))
        predicted = 1 * GIB // kv_bytes_per_token(shape, layout, DTYPE_BYTES["bfloat16"])  # VLLM_CPU_KVCACHE_SPACE
        difference = predicted / reported - 1
        record_property(f"kv_capacity_{name}", {"predicted": predicted, "vllm": reported, "difference": difference})
        print(f"tiny MoE {layout}: planner {predicted:,} KV tokens, vLLM {reported:,} ({difference:+.2%})")
        assert abs(difference) < 0.10
    assert "'enable_expert_parallel': True" in logs["tp2-ep"]  # vLLM's own list of the arguments it took
