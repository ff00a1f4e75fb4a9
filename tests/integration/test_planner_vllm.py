"""The planner's KV capacity against what the real vLLM CPU engine reports at start-up:
the demo model here, on the session's engine; a tiny MoE on the engine the bundle test
(test_bundle_install.py) starts from the bundle, which carries it."""

from __future__ import annotations

import re

import pytest

from appliance.engine_launch import resolve_device, resolve_dtype
from appliance.settings import load_settings
from installer.memory import GIB, Layout, kv_bytes_per_token
from installer.model_config import DTYPE_BYTES, load_model_config
from tests.integration.conftest import Running


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
