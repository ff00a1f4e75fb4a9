"""Engine start-up and single-stream speed of the demo model.

Figures, each against a baseline measured in the same invocation:
- time from `appliance up` (PostgreSQL, Keycloak, engine, gateway, workers) to the engine's first
  streamed token, asked for while `up` runs (the engine waits on nothing else), vs. launching the
  same vLLM command directly (no supervisord, no appliance) to its first token: the appliance's
  start overhead; and when `up` itself returns (every program ready, the realm provisioned);
- steady single-stream decode tokens/s through the supervised engine, vs. transformers'
  `generate` on the same model, prompt and greedy settings in this process.

Run: .venv/bin/python bench/engine_start.py   (needs ./bootstrap.sh --no-start first)
Writes bench/results/engine_start.json.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from appliance.engine_launch import engine_socket
from appliance.home import HOME_ENV, Home
from appliance.secrets import secret
from appliance.settings import load_settings
from installer.keycloak import install_dir
from serve.engine import build_launch

RESULTS = Path(__file__).parent / "results" / "engine_start.json"
PROMPT = "Write a short story about a lighthouse keeper."
MAX_TOKENS = 128
APPLIANCE = str(Path(sys.executable).with_name("appliance"))


def engine(socket: Path, timeout: float) -> httpx.Client:
    """A client to the engine over its Unix socket (engines listen on no TCP port)."""
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(socket)), base_url="http://engine", timeout=timeout)


def first_token_s(socket: Path, key: str, started: float, deadline_s: float = 900) -> float:
    """Poll until the server streams a first token; seconds since `started`."""
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 1, "stream": True,
            "messages": [{"role": "user", "content": "Hi"}]}
    while time.monotonic() - started < deadline_s:
        try:
            with engine(socket, 60) as http, http.stream("POST", "/v1/chat/completions", json=body,
                                                         headers={"Authorization": f"Bearer {key}"}) as response:
                if response.status_code == 200:
                    for line in response.iter_lines():
                        if line.startswith("data:") and '"content"' in line:
                            return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"no token from {socket} within {deadline_s}s")


def decode_tokens_per_s(socket: Path, key: str, runs: int = 3) -> float:
    """Completion tokens per second of greedy single-stream requests (best of `runs`)."""
    best = 0.0
    for _ in range(runs):
        t0 = time.monotonic()
        with engine(socket, 300) as http:
            response = http.post(
                "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                json={"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": MAX_TOKENS,
                      "ignore_eos": True, "messages": [{"role": "user", "content": PROMPT}]},
            )
        response.raise_for_status()
        tokens = response.json()["usage"]["completion_tokens"]
        best = max(best, tokens / (time.monotonic() - t0))
    return best


def transformers_tokens_per_s(model_dir: Path, dtype: str, runs: int = 3) -> float:
    """The baseline: transformers generate, greedy, same prompt, token count and dtype."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    # Any: transformers' generate() and chat template results are unions mypy cannot narrow here.
    tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                           add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    best = 0.0
    for _ in range(runs):
        t0 = time.monotonic()
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                             do_sample=False)
        tokens = out.shape[1] - inputs["input_ids"].shape[1]
        best = max(best, tokens / (time.monotonic() - t0))
    return best


def main() -> None:
    # Unwind on SIGTERM/SIGINT so `finally` runs `appliance down` (a background job started by a
    # non-interactive shell inherits SIGINT ignored; Python's default SIGTERM does not unwind).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    default = Home.from_env()
    demo = default.demo_model
    root = Path(tempfile.mkdtemp(prefix="apb-", dir="/tmp"))
    root.chmod(0o711)  # PostgreSQL's user passes through to its own directory
    home = Home(root / "h").ensure()
    home.demo_model.symlink_to(demo, target_is_directory=True)
    # `up` starts the whole appliance (Keycloak and the gateway too), as an operator's would.
    shutil.copytree(install_dir(default), install_dir(home), symlinks=True,
                    ignore=shutil.ignore_patterns("h2", "tmp"))
    env = {**os.environ, HOME_ENV: str(home.root), "APPLIANCE_GATEWAY__PORT": "18380",
           "APPLIANCE_KEYCLOAK__PORT": "18390", "APPLIANCE_KEYCLOAK__MANAGEMENT_PORT": "18391",
           "APPLIANCE_KEYCLOAK__POSTGRES_PORT": "18392"}
    key = secret(home, "engine-api-key")
    socket = engine_socket(home, "main")
    try:
        # Baseline 1: the same vLLM command, launched directly.
        settings = load_settings(home.settings_file, environ={})
        socket.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # as `up` has it made
        launch = build_launch(settings.pools[0], settings, home, key)
        t0 = time.monotonic()
        direct = subprocess.Popen(launch.argv, env={**os.environ, **launch.environment},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        try:
            direct_first = first_token_s(socket, key, t0)
        finally:
            os.killpg(direct.pid, 15)
            direct.wait(60)
            socket.unlink(missing_ok=True)
        time.sleep(3)
        # The appliance: `appliance up` to first token, then steady decode speed.
        t0 = time.monotonic()
        up = subprocess.Popen([APPLIANCE, "up"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        up_first = first_token_s(socket, key, t0)
        output, _ = up.communicate()
        up_returned = time.monotonic() - t0
        if up.returncode != 0:
            raise SystemExit(f"appliance up failed:\n{output}")
        engine_tps = decode_tokens_per_s(socket, key)
        subprocess.run([APPLIANCE, "down"], env=env, check=True, capture_output=True)
        dtype = launch.argv[launch.argv.index("--dtype") + 1]
        hf_tps = transformers_tokens_per_s(demo, dtype)
    finally:
        subprocess.run([APPLIANCE, "down"], env=env, capture_output=True)
        shutil.rmtree(root, ignore_errors=True)

    result = {
        "bench": "engine_start",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host_cpus": len(os.sched_getaffinity(0)),
        "model": f"SmolLM2-135M-Instruct {dtype}, vLLM CPU 0.32.0, --enforce-eager",
        "up_starts": "postgres + keycloak + vllm-main + gateway + workers, then realm provisioning",
        "up_to_first_token_s": round(up_first, 1),
        "direct_vllm_to_first_token_s": round(direct_first, 1),
        "start_ratio_up_vs_direct": round(up_first / direct_first, 2),
        "up_returned_s": round(up_returned, 1),
        "up_returned_ratio_vs_direct": round(up_returned / direct_first, 2),
        "engine_decode_tokens_per_s": round(engine_tps, 1),
        "transformers_generate_tokens_per_s": round(hf_tps, 1),
        "decode_ratio_engine_vs_transformers": round(engine_tps / hf_tps, 2),
        "max_tokens": MAX_TOKENS,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    for name, value in result.items():
        print(f"{name:40} {value}")


if __name__ == "__main__":
    main()
