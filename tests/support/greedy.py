"""Greedy answers from the real vLLM CPU engine through its offline API, each engine in a fresh
interpreter of its own process group (tests/integration/vllm_greedy.py), and the engine's log."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

GREEDY = Path(__file__).parent.parent / "integration" / "vllm_greedy.py"
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,")
ENGINE_TIMEOUT_S = 600


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
