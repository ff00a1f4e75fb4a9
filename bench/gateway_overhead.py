"""Gateway overhead: the same load straight to vLLM and through the gateway (auth on), in one run.

For concurrency 1, 8 and 32, streamed and not, both paths take turns (direct, gateway, direct,
gateway) on the same engine, so drift on this noisy machine hits both. Reports p50/p99 latency of
each path, the added p50/p99 and the throughput ratio (gateway / direct).

Run: .venv/bin/python bench/gateway_overhead.py   (needs ./bootstrap.sh --no-start first)
Writes bench/results/gateway_overhead.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from appliance.home import HOME_ENV, Home
from appliance.secrets import secret
from appliance.settings import load_settings
from installer.keycloak import install_dir
from installer.realm import BOOTSTRAP_SECRET

RESULTS = Path(__file__).parent / "results" / "gateway_overhead.json"
APPLIANCE = str(Path(sys.executable).with_name("appliance"))
MODEL = "SmolLM2-135M-Instruct"
REQUESTS_PER_WORKER = {1: 40, 8: 12, 32: 6}
ROUNDS = 2


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def one(client: httpx.AsyncClient, url: str, headers: dict, stream: bool) -> float:
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": "Say OK."}]}
    started = time.perf_counter()
    if stream:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            response.raise_for_status()
            async for _ in response.aiter_raw():
                pass
    else:
        response = await client.post(url, json=body, headers=headers)
        response.raise_for_status()
    return time.perf_counter() - started


async def load(url: str, headers: dict, concurrency: int, stream: bool) -> tuple[list[float], float]:
    """Latencies of every request and requests/s, `concurrency` workers in parallel."""
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        await one(client, url, headers, stream)  # warm the connection
        latencies: list[float] = []

        async def worker() -> None:
            for _ in range(REQUESTS_PER_WORKER[concurrency]):
                latencies.append(await one(client, url, headers, stream))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, len(latencies) / (time.perf_counter() - started)


def start_appliance() -> tuple[Path, dict[str, str]]:
    root = Path(tempfile.mkdtemp(prefix="apg-", dir="/tmp"))
    home = Home(root / "h").ensure()
    default = Home.from_env()
    home.demo_model.symlink_to(default.demo_model, target_is_directory=True)
    shutil.copytree(install_dir(default), install_dir(home), symlinks=True,
                    ignore=shutil.ignore_patterns("h2", "tmp"))
    env = {**os.environ, HOME_ENV: str(home.root), "APPLIANCE_POOLS__MAIN__PORT": "18411",
           "APPLIANCE_GATEWAY__PORT": "18480", "APPLIANCE_KEYCLOAK__PORT": "18490",
           "APPLIANCE_KEYCLOAK__MANAGEMENT_PORT": "18491",
           # The bench measures overhead, not the limiter: give the admin a budget it never meets.
           "APPLIANCE_GATEWAY__LIMITS": "{ admin = { requests_per_minute = 10000000, tokens_per_minute = 1000000000 } }"}
    subprocess.run([APPLIANCE, "up"], env=env, check=True, capture_output=True)
    return root, env


def main() -> None:
    root, env = start_appliance()
    home = Home(Path(env[HOME_ENV]))
    try:
        settings = load_settings(home.settings_file, environ=env)
        token = httpx.post(f"{settings.keycloak.issuer}/protocol/openid-connect/token",
                           data={"grant_type": "password", "client_id": "appliance-cli", "username": "admin",
                                 "password": secret(home, BOOTSTRAP_SECRET)}).json()["access_token"]
        paths = {
            "direct": ("http://127.0.0.1:18411/v1/chat/completions",
                       {"Authorization": f"Bearer {secret(home, 'engine-api-key')}"}),
            "gateway": ("http://127.0.0.1:18480/v1/chat/completions", {"Authorization": f"Bearer {token}"}),
        }
        rows = []
        for stream in (False, True):
            for concurrency in (1, 8, 32):
                samples: dict[str, list[float]] = {"direct": [], "gateway": []}
                rates: dict[str, list[float]] = {"direct": [], "gateway": []}
                for _ in range(ROUNDS):
                    for name, (url, headers) in paths.items():
                        latencies, rate = asyncio.run(load(url, headers, concurrency, stream))
                        samples[name] += latencies
                        rates[name].append(rate)
                row = {"stream": stream, "concurrency": concurrency, "requests": len(samples["gateway"])}
                for name in paths:
                    row[f"{name}_p50_ms"] = round(percentile(samples[name], 0.5) * 1000, 1)
                    row[f"{name}_p99_ms"] = round(percentile(samples[name], 0.99) * 1000, 1)
                    row[f"{name}_rps"] = round(statistics.mean(rates[name]), 2)
                row["added_p50_ms"] = round(row["gateway_p50_ms"] - row["direct_p50_ms"], 1)
                row["added_p99_ms"] = round(row["gateway_p99_ms"] - row["direct_p99_ms"], 1)
                row["throughput_ratio"] = round(row["gateway_rps"] / row["direct_rps"], 3)
                rows.append(row)
                print(json.dumps(row))
    finally:
        subprocess.run([APPLIANCE, "down"], env=env, capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
    result = {"bench": "gateway_overhead",
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "host_cpus": len(os.sched_getaffinity(0)),
              "note": "vLLM CPU engine and gateway share 2 cores; max_tokens=4; auth with introspection (10 s cache)",
              "rows": rows}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
