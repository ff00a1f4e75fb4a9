"""Engine start-up and single-stream speed of the demo model.

Figures, each against a baseline measured in the same invocation, the paths taking turns over
ROUNDS rounds (medians reported):
- time from `appliance up` (PostgreSQL, Keycloak, engine, gateway, workers) to the engine's first
  streamed token, asked for while `up` runs (the engine waits on nothing else), vs. launching the
  same vLLM command directly (no supervisord, no appliance) to its first token: the appliance's
  start overhead. Twice: the first `up` of a new home (PostgreSQL's cluster and Keycloak's schema
  made) and a restart (`down`, then `up`);
- on the restart, the first token through the gateway too, for an application's API key (made
  after the first start; its owner's roles come from Keycloak, so it waits on Keycloak as well as
  the engine), and when `up` itself returns (every program ready);
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
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from appliance.engine_launch import engine_socket
from appliance.home import HOME_ENV, Home
from appliance.secrets import secret
from appliance.settings import Settings, load_settings
from installer.keycloak_dist import install_dir
from installer.realm import BOOTSTRAP_SECRET
from serve.engine import build_launch

RESULTS = Path(__file__).parent / "results" / "engine_start.json"
PROMPT = "Write a short story about a lighthouse keeper."
MAX_TOKENS = 128
APPLIANCE = str(Path(sys.executable).with_name("appliance"))
ROUNDS = 3
PORTS = {"APPLIANCE_GATEWAY__PORT": "18380", "APPLIANCE_KEYCLOAK__PORT": "18390",
         "APPLIANCE_KEYCLOAK__MANAGEMENT_PORT": "18391", "APPLIANCE_KEYCLOAK__POSTGRES_PORT": "18392"}


def engine(socket: Path, timeout: float) -> httpx.Client:
    """A client to the engine over its Unix socket (engines listen on no TCP port)."""
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(socket)), base_url="http://engine", timeout=timeout)


def streams_a_token(http: httpx.Client, url: str, headers: dict[str, str]) -> bool:
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 1, "stream": True,
            "messages": [{"role": "user", "content": "Hi"}]}
    try:
        with http.stream("POST", url, json=body, headers=headers) as response:
            return response.status_code == 200 and any(
                line.startswith("data:") and '"content"' in line for line in response.iter_lines())
    except httpx.HTTPError:
        return False


def seconds_until(asks: Callable[[], bool], started: float, what: str, deadline_s: float = 900) -> float:
    """Poll until `asks` is answered; seconds since `started`."""
    while time.monotonic() - started < deadline_s:
        if asks():
            return time.monotonic() - started
        time.sleep(0.2)
    raise TimeoutError(f"no {what} within {deadline_s}s")


def engine_token_s(socket: Path, key: str, started: float) -> float:
    """Seconds from `started` to the engine's first streamed token, asked over its socket."""
    def asks() -> bool:
        with engine(socket, 60) as http:
            return streams_a_token(http, "/v1/chat/completions", {"Authorization": f"Bearer {key}"})
    return seconds_until(asks, started, f"token from {socket}")


def api_key(env: dict[str, str], home: Home) -> str:
    """An API key for the administrator, as an application would be given (the appliance is up)."""
    login = subprocess.run([APPLIANCE, "token", "--user", "admin", "--password-stdin"], env=env, text=True,
                           input=secret(home, BOOTSTRAP_SECRET) + "\n", capture_output=True, check=True)
    created = subprocess.run([APPLIANCE, "keys", "create", "bench", "--user", "admin", "--json"], env=env,
                             text=True, capture_output=True, check=False)
    if login.returncode != 0 or created.returncode != 0:
        raise SystemExit(f"could not make an API key: {login.stderr}{created.stderr}")
    return str(json.loads(created.stdout)["secret"])


def gateway_token_s(settings: Settings, key: str, started: float) -> float:
    """Seconds from `started` to a first token through the gateway for an application's API key
    (its owner's roles come from Keycloak, so this waits on Keycloak as well as the engine)."""
    def asks() -> bool:
        with httpx.Client(timeout=60) as http:
            return streams_a_token(http, f"http://127.0.0.1:{settings.gateway.port}/v1/chat/completions",
                                   {"Authorization": f"Bearer {key}"})
    return seconds_until(asks, started, "token through the gateway")


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


def new_home(default: Home) -> tuple[Path, Home]:
    """A home as the installer leaves it: the demo model and Keycloak's install, nothing started."""
    root = Path(tempfile.mkdtemp(prefix="apb-", dir="/tmp"))
    root.chmod(0o711)  # PostgreSQL's user passes through to its own directory
    home = Home(root / "h").ensure()
    home.demo_model.symlink_to(default.demo_model, target_is_directory=True)
    shutil.copytree(install_dir(default), install_dir(home), symlinks=True,
                    ignore=shutil.ignore_patterns("h2", "tmp"))
    return root, home


def direct_start(home: Home) -> float:
    """The baseline: the engine's own vLLM command, launched alone, to its first token."""
    settings = load_settings(home.settings_file, environ={})
    key, socket = secret(home, "engine-api-key"), engine_socket(home, "main")
    socket.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # as `up` has it made
    launch = build_launch(settings.pools[0], settings, home, key)
    started = time.monotonic()
    direct = subprocess.Popen(launch.argv, env={**os.environ, **launch.environment}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        return engine_token_s(socket, key, started)
    finally:
        os.killpg(direct.pid, signal.SIGTERM)
        direct.wait(60)
        socket.unlink(missing_ok=True)


def up_start(home: Home, env: dict[str, str], application_key: str | None = None) -> dict[str, float]:
    """`appliance up` to the engine's first token (and the gateway's, for `application_key`), and
    to its return."""
    settings = load_settings(home.settings_file, environ=env)
    key, socket = secret(home, "engine-api-key"), engine_socket(home, "main")
    started = time.monotonic()
    up = subprocess.Popen([APPLIANCE, "up"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        figures = {"engine_token_s": engine_token_s(socket, key, started)}
        if application_key is not None:
            figures["gateway_token_s"] = gateway_token_s(settings, application_key, started)
        output, _ = up.communicate(timeout=900)
    finally:
        if up.poll() is None:
            up.kill()
    figures["returned_s"] = time.monotonic() - started
    if up.returncode != 0:
        raise SystemExit(f"appliance up failed:\n{output}")
    return figures


def median(rounds: list[dict[str, float]], name: str) -> float:
    return statistics.median(r[name] for r in rounds)


def main() -> None:
    # Unwind on SIGTERM/SIGINT so `finally` runs `appliance down` (a background job started by a
    # non-interactive shell inherits SIGINT ignored; Python's default SIGTERM does not unwind).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    default = Home.from_env()
    direct: list[float] = []
    first: list[dict[str, float]] = []
    restart: list[dict[str, float]] = []
    for _ in range(ROUNDS):
        root, home = new_home(default)
        env = {**os.environ, HOME_ENV: str(home.root), "XDG_CONFIG_HOME": str(root / "config"), **PORTS}
        try:
            direct.append(direct_start(home))
            time.sleep(3)
            first.append(up_start(home, env))
            application_key = api_key(env, home)
            subprocess.run([APPLIANCE, "down"], env=env, check=True, capture_output=True)
            time.sleep(3)
            restart.append(up_start(home, env, application_key))
            if len(restart) == ROUNDS:  # the last round measures decode speed too
                engine_key, socket = secret(home, "engine-api-key"), engine_socket(home, "main")
                engine_tps = decode_tokens_per_s(socket, engine_key)
                settings = load_settings(home.settings_file, environ={})
                argv = build_launch(settings.pools[0], settings, home, engine_key).argv
                dtype = argv[argv.index("--dtype") + 1]
        finally:
            subprocess.run([APPLIANCE, "down"], env=env, capture_output=True)
            shutil.rmtree(root, ignore_errors=True)
    hf_tps = transformers_tokens_per_s(default.demo_model, dtype)
    baseline = statistics.median(direct)
    result = {
        "bench": "engine_start",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host_cpus": len(os.sched_getaffinity(0)),
        "model": f"SmolLM2-135M-Instruct {dtype}, vLLM CPU 0.32.0, --enforce-eager",
        "up_starts": "postgres + keycloak + prometheus + alertmanager (at engine.yield_nice 19 until every program "
                     "is ready) + vllm-main + gateway + workers, then realm provisioning",
        "rounds": ROUNDS,
        "direct_vllm_to_first_token_s": round(baseline, 1),
        "first_up_to_engine_token_s": round(median(first, "engine_token_s"), 1),
        "first_up_start_ratio_vs_direct": round(median(first, "engine_token_s") / baseline, 2),
        "first_up_returned_s": round(median(first, "returned_s"), 1),
        "restart_up_to_engine_token_s": round(median(restart, "engine_token_s"), 1),
        "restart_start_ratio_vs_direct": round(median(restart, "engine_token_s") / baseline, 2),
        "restart_up_to_gateway_token_s": round(median(restart, "gateway_token_s"), 1),
        "restart_gateway_ratio_vs_direct": round(median(restart, "gateway_token_s") / baseline, 2),
        "restart_up_returned_s": round(median(restart, "returned_s"), 1),
        "each_round": {"direct": [round(d, 1) for d in direct],
                       "first_up": [{k: round(v, 1) for k, v in r.items()} for r in first],
                       "restart": [{k: round(v, 1) for k, v in r.items()} for r in restart]},
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
