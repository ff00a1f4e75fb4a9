"""What serving adapters costs an engine that answers the base model: the demo model's CPU engine
launched with `pools.NAME.enable_lora` on (the default) and off, taking turns over ROUNDS rounds,
each launched alone from its own vLLM command (bench.engine_start's direct start):
- seconds from launch to the first streamed token;
- the engine's resident memory once it answers (every process of its session, summed);
- greedy single-stream decode tokens/s of the base model (no adapter asked for).

Run: .venv/bin/python -m bench.lora_cost [--rounds N]   (needs ./bootstrap.sh --no-start first)
Writes bench/results/lora_cost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

from appliance.engine_launch import engine_socket
from appliance.home import Home
from appliance.secrets import secret
from appliance.settings import load_settings
from bench.engine_start import decode_tokens_per_s, engine_token_s, new_home
from serve.engine import build_launch

RESULTS = Path(__file__).parent / "results" / "lora_cost.json"
PATHS = {"lora_on": "true", "lora_off": "false"}


def session_rss_mib(leader: int) -> float:
    """Resident memory of the leader and every process below it, MiB."""
    root = psutil.Process(leader)
    total = 0
    for process in [root, *root.children(recursive=True)]:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total / 2**20


def one_start(home: Home, enable_lora: str) -> dict[str, float]:
    """Launch the engine's vLLM command with LoRA on or off; its start, memory and decode speed."""
    settings = load_settings(home.settings_file, environ={"APPLIANCE_POOLS__MAIN__ENABLE_LORA": enable_lora})
    key, socket = secret(home, "engine-api-key"), engine_socket(home, "main")
    socket.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    launch = build_launch(settings.pools[0], settings, home, key)
    assert ("--enable-lora" in launch.argv) == (enable_lora == "true"), launch.argv
    started = time.monotonic()
    engine = subprocess.Popen(launch.argv, env={**os.environ, **launch.environment}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        first_token_s = engine_token_s(socket, key, started)
        tokens_per_s = decode_tokens_per_s(socket, key)
        return {"first_token_s": first_token_s, "rss_mib": session_rss_mib(engine.pid),
                "decode_tokens_per_s": tokens_per_s}
    finally:
        os.killpg(engine.pid, signal.SIGTERM)
        engine.wait(120)
        socket.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    # Unwind on SIGTERM/SIGINT so that `finally` stops the engine (as bench.engine_start).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    root, home = new_home(Home.from_env())
    try:
        rounds: dict[str, list[dict[str, float]]] = {path: [] for path in PATHS}
        for turn in range(args.rounds):
            order = list(PATHS) if turn % 2 == 0 else list(reversed(PATHS))  # paths take turns
            for path in order:
                rounds[path].append(one_start(home, PATHS[path]))
                print(path, rounds[path][-1], flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    medians = {path: {name: round(statistics.median(r[name] for r in runs), 2) for name in runs[0]}
               for path, runs in rounds.items()}
    on, off = medians["lora_on"], medians["lora_off"]
    result = {"rounds": args.rounds, "medians": medians, "runs": rounds,
              "ratios_on_to_off": {name: round(on[name] / off[name], 3) for name in on}}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["medians"]), json.dumps(result["ratios_on_to_off"]))


if __name__ == "__main__":
    main()
