"""A `subset`-staged checkpoint loads in the real vLLM CPU engine and answers exactly as the
original does (issue 6)."""

from __future__ import annotations

from pathlib import Path

import httpx

from appliance.secrets import secret
from installer.hardware import parse_hardware_spec
from installer.model_config import load_model_config
from installer.planner import plan
from installer.staging import stage_subset, verify_staged
from serve.engine import ENGINE_KEY_SECRET
from tests.conftest import Appliance, make_appliance
from tests.integration.conftest import Running

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def greedy(appliance: Appliance, model: str) -> list[tuple[str, list[float]]]:
    url = f"http://127.0.0.1:{appliance.port('APPLIANCE_POOLS__MAIN__PORT')}/v1/completions"
    headers = {"Authorization": f"Bearer {secret(appliance.home, ENGINE_KEY_SECRET)}"}
    answers = []
    for prompt in PROMPTS:
        body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 1}
        choice = httpx.post(url, headers=headers, json=body, timeout=120).json()["choices"][0]
        answers.append((choice["text"], choice["logprobs"]["token_logprobs"]))
    return answers


def test_single_host_subset_serves_like_the_original(running: Running, demo_model: Path, tmp_path: Path) -> None:
    record = plan(load_model_config(demo_model), parse_hardware_spec("1x1xL4-24GB"), context=2048, concurrency=1,
                  model_ref=str(demo_model))
    [staged] = stage_subset(demo_model, record, tmp_path / "staged")
    assert verify_staged(staged.directory)
    original = greedy(running.appliance, "SmolLM2-135M-Instruct")
    for appliance in make_appliance(None, APPLIANCE_POOLS__MAIN__MODEL=str(staged.directory),
                                    APPLIANCE_POOLS__MAIN__SERVED_MODEL_NAME="staged"):
        started = appliance.run("up", timeout=900)
        assert started.returncode == 0, started.stderr
        answers = greedy(appliance, "staged")
    for (text, logprobs), (want, want_logprobs) in zip(answers, original):
        assert text == want
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 1e-3
