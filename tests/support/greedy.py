"""The real vLLM CPU engine for tests, each in a fresh interpreter of its own process group: greedy
answers through its offline API (tests/integration/vllm_greedy.py) with the engine's log, and the
KV capacity each data-parallel engine of `vllm serve` reports at start-up."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.ports import free_port

GREEDY = Path(__file__).parent.parent / "integration" / "vllm_greedy.py"
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,")
ENGINE_TIMEOUT_S = 600
KV_SIZE = re.compile(r"KV cache size: ([\d,]+) tokens")  # an engine's start-up line
# The same line goes on with the longest request it counts the capacity in.
KV_REQUEST = re.compile(r"KV cache size: [\d,]+ tokens, Maximum concurrency for ([\d,]+) tokens per request")
# vLLM's CPU platform pages the KV cache in blocks of 128 tokens (vllm/platforms/cpu.py; MLA's and
# DeepSeek-V4's kernels excepted, which none of these tests' models use).
CPU_BLOCK_TOKENS = 128


def held_in_blocks(tokens: int, request_tokens: int) -> int:
    """The KV capacity the CPU engine reports for a budget that holds `tokens`: the whole blocks
    among them, logged as the requests of `request_tokens` that fit times their length (vLLM's
    get_kv_cache_capacity), which is the blocks' tokens when the length is whole blocks."""
    blocks = tokens // CPU_BLOCK_TOKENS
    return int(blocks / -(-request_tokens // CPU_BLOCK_TOKENS) * request_tokens)


def reported_kv(log: str) -> tuple[int, int]:
    """An engine's last KV capacity line: the tokens and the request length it counted them in."""
    tokens, request = KV_SIZE.findall(log)[-1], KV_REQUEST.findall(log)[-1]
    return int(tokens.replace(",", "")), int(request.replace(",", ""))


def generate(model: Path, work: Path, name: str, *, tp: int = 2, load_format: str = "auto",
             expert_parallel: bool = False, prompts: tuple[str, ...] = PROMPTS) -> tuple[list[dict[str, Any]], str]:
    """Greedy answers to `prompts` from a TP=`tp` engine with one core per rank, and its log
    (`work/NAME.log`); no prompts: the engine only starts."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tp:
        pytest.skip(f"tensor parallel {tp} on the CPU needs {tp} cores")
    # As serve/engine.py sets up a CPU pool: a fixed KV budget and one core per rank.
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, cores[:tp])),
                        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                        "DO_NOT_TRACK": "1", "VLLM_LOGGING_LEVEL": "INFO"}  # importing TRL lowers it to ERROR
    out, log = work / f"{name}.json", work / f"{name}.log"
    argv = [sys.executable, "-P", str(GREEDY), str(model), str(out), "--tp", str(tp), "--load-format", load_format]
    if expert_parallel:
        argv.append("--enable-expert-parallel")
    for prompt in prompts:
        argv += ["--prompt", prompt]
    with log.open("w") as sink:
        engine = subprocess.Popen(argv, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = engine.wait(timeout=ENGINE_TIMEOUT_S)
        finally:
            # The group is the engine and the workers it spawned: nothing else is in it.
            try:
                os.killpg(engine.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            engine.wait()
    text = log.read_text()
    assert returncode == 0, f"vLLM ({name}) exited {returncode}:\n{text[-4000:]}"
    return json.loads(out.read_text()), text


def kv_tokens_at_start(model: Path, work: Path, name: str, *, dp: int) -> list[int]:
    """Each engine's KV capacity as it reports it at start-up, from `vllm serve` (the appliance's
    serve.vllm_rank) with `dp` data-parallel engines of one core each on loopback; stopped once
    every engine has sized its cache."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < dp:
        pytest.skip(f"data parallel {dp} on the CPU needs {dp} cores")
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, cores[:dp])),
                        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                        "DO_NOT_TRACK": "1", "VLLM_LOGGING_LEVEL": "INFO"}
    log = work / f"{name}.log"
    argv = [sys.executable, "-P", "-m", "serve.vllm_rank", "--model", str(model), "--data-parallel-size", str(dp),
            "--dtype", "bfloat16", "--max-model-len", "512", "--enforce-eager", "--host", "127.0.0.1",
            "--port", str(free_port())]
    found: list[int] = []
    with log.open("w") as sink:
        engine = subprocess.Popen(argv, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                  cwd=Path(__file__).parent.parent.parent)
        try:
            deadline = time.monotonic() + ENGINE_TIMEOUT_S
            while len(found) < dp and engine.poll() is None and time.monotonic() < deadline:
                time.sleep(1)
                found = [int(n.replace(",", "")) for n in KV_SIZE.findall(log.read_text())]
        finally:
            try:
                os.killpg(engine.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            engine.wait()
    assert len(found) == dp, f"vLLM ({name}) sized {len(found)} of {dp} engines' caches:\n{log.read_text()[-4000:]}"
    return found
