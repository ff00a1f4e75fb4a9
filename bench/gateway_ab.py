"""The gateway as of an earlier commit and as it is now, side by side in one run: concurrency 1,
each request interleaved with the other gateway's and with each one's own stand-in engine (an
instant stub on the gateway's engine socket), so the VM's phase hits both alike (two separate
runs of bench/gateway_overhead.py, hours apart, differed by more than the code did). Each
gateway's added latency is against its own stub, at the median and in the tail (p99, p99.9):
the tail is where a stall on the event loop (a full garbage collection, a signature, an fsync)
shows, once every few hundred requests. Both gateways validate real Keycloak tokens (the
appliance's own Keycloak) and run the default compliance policy.

With --prose, each prompt is a kilobyte of ordinary prose (numbers, a version, a commit id, words
that begin key prefixes; its last number differs from request to request) instead of "Say OK.", so
that the compliance filter's scan of a prompt shows in the added latency.

Run: .venv/bin/python -m bench.gateway_ab [--before REV] [--after REV] [--requests N] [--prose] [--probe-stalls]
(needs ./bootstrap.sh --no-start; REV: any commit whose engines listen on Unix sockets; without
--after the working tree is measured, with it that commit, so that changes others have not yet
committed stay out of the comparison).
Writes bench/results/gateway_ab.json (gateway_ab_prose.json with --prose); with --probe-stalls
(bench/stall_probe: its own cost distorts the figures, so it writes them nowhere) prints what
stalled each gateway's event loop: full garbage collections and the code the loop was in when a
ping waited over 3 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from appliance.engine_launch import engine_socket
from appliance.home import HOME_ENV, Home
from appliance.secrets import secret
from appliance.settings import load_settings
from appliance.tls import keycloak_ssl, tls_dir
from bench import gateway_overhead as g  # the sibling bench: its appliance set-up, paths and interleaved load
from installer.realm import BOOTSTRAP_SECRET

PROJECT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results" / "gateway_ab.json"
BEFORE = "606ba0a"  # the last commit before the second attack's mends
PORTS = {"before": 18482, "after": 18481}
PROSE = ("The rollout of version 3.12.1 finished at 14:32 on 2024-05-17: eight replicas on two hosts, commit "
         "9fceb02d0ae598e95dc970b74767f19372d61af8, 42 minutes in all. Ask the team before the next skill review; "
         "the sky-blue dashboards show 1,234 requests a minute at 0.8 s p99, and room 1204 has the runbook. "
         "Step 1: drain host A. Step 2: restart the pool. Step 3: check the KV cache (about 61 % used). ") * 3
LIMITS = "{ admin = { requests_per_minute = 10000000, tokens_per_minute = 1000000000, max_concurrent = 10000 } }"


def start_gateway(tree: Path, home: Home, port: int, base: dict[str, str],
                  probe: Path | None) -> list[subprocess.Popen[bytes]]:
    """A stub engine on `home`'s engine socket and the gateway of `tree` in front of it (with the
    stall probe writing to `probe`, if given)."""
    sock = engine_socket(home, "main")
    sock.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    stub = subprocess.Popen([sys.executable, "-m", "uvicorn", "bench.stub_engine:app", "--uds", str(sock),
                             "--log-level", "warning"], cwd=PROJECT)
    gateway = subprocess.Popen([sys.executable, "-P", "-m", "serve.listener"], cwd=tree, stderr=subprocess.DEVNULL,
                               env={**base, HOME_ENV: str(home.root), **probed(tree, probe),
                                    "APPLIANCE_GATEWAY__PORT": str(port), "APPLIANCE_GATEWAY__LIMITS": LIMITS,
                                    "APPLIANCE_POOLS__MAIN__SERVED_MODEL_NAME": g.MODEL})
    return [stub, gateway]


def probed(tree: Path, probe: Path | None) -> dict[str, str]:
    if probe is None:
        return {"PYTHONPATH": str(tree)}
    return {"PYTHONPATH": f"{tree}:{Path(__file__).parent / 'stall_probe'}", "STALL_PROBE_OUT": str(probe)}


def percentiles(samples: dict[str, list[float]], q: float) -> dict[str, float]:
    return {name: round(g.percentile(values, q) * 1000, 3) for name, values in samples.items()}


def row(stream: bool, requests: int, samples: dict[str, list[float]], cpu_ms: dict[str, float]) -> dict[str, object]:
    p50, p99, p999 = (percentiles(samples, q) for q in (0.5, 0.99, 0.999))
    added = {q: {side: round(p[side] - p[f"stub_{side}"], 3) for side in PORTS}
             for q, p in (("p50", p50), ("p99", p99), ("p99.9", p999))}
    return {"stream": stream, "requests": requests, "p50_ms": p50, "p99_ms": p99, "p99.9_ms": p999,
            "added_ms": added,
            "added_p50_ratio_after_to_before": round(added["p50"]["after"] / added["p50"]["before"], 3),
            "added_p99_ratio_after_to_before": round(added["p99"]["after"] / added["p99"]["before"], 3),
            "gateway_cpu_ms_per_request": cpu_ms,
            "cpu_ratio_after_to_before": round(cpu_ms["after"] / cpu_ms["before"], 3)}


async def load_prose(paths: dict[str, tuple[str, dict[str, str]]], stream: bool,
                     requests: int) -> dict[str, list[float]]:
    """As g.load_interleaved (concurrency 1, the paths taking turns in a fresh random order), each
    prompt PROSE and a number that changes with every request."""
    rng, numbers = random.Random(1), itertools.count()
    order = list(paths)
    latencies: dict[str, list[float]] = {name: [] for name in paths}

    async def one(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> float:
        body = {"model": g.MODEL, "max_tokens": 4, "temperature": 0, "stream": stream,
                "messages": [{"role": "user", "content": f"{PROSE}Ticket {next(numbers)}."}]}
        started = time.perf_counter()
        async with client.stream("POST", url, json=body, headers=headers) as response:
            response.raise_for_status()
            async for _ in response.aiter_raw():
                pass
        return time.perf_counter() - started

    async with contextlib.AsyncExitStack() as stack:
        clients, urls = {}, {}
        for name, (url, headers) in paths.items():
            http, urls[name] = g.http_client(url, timeout=300)
            clients[name] = await stack.enter_async_context(http)
            await one(clients[name], urls[name], headers)  # warm the connection
        for _ in range(requests):
            rng.shuffle(order)
            for name in order:
                latencies[name].append(await one(clients[name], urls[name], paths[name][1]))
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=BEFORE, help="the earlier commit")
    parser.add_argument("--after", default=None, help="the later commit (default: the working tree)")
    parser.add_argument("--requests", type=int, default=2000, help="requests per path and shape")
    parser.add_argument("--probe-stalls", action="store_true", help="find what stalls each gateway's loop")
    parser.add_argument("--prose", action="store_true", help="prompts of a kilobyte of prose, not 'Say OK.'")
    options = parser.parse_args()
    trees = {"before": Path(tempfile.mkdtemp(prefix="gw-before-")), "after": PROJECT}
    if options.after is not None:
        trees["after"] = Path(tempfile.mkdtemp(prefix="gw-after-"))
    for side, rev in (("before", options.before), ("after", options.after)):
        if rev is not None:
            subprocess.run(["git", "worktree", "add", "--detach", "-f", str(trees[side]), rev], cwd=PROJECT,
                           check=True, capture_output=True)
    root, env = g.start_appliance()
    home = Home(Path(env[HOME_ENV]))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        settings = load_settings(home.settings_file, environ=env)
        homes = {}
        for side in PORTS:
            homes[side] = Home(home.root.with_name(f"gw-{side}")).ensure()
            shutil.copytree(home.secrets, homes[side].secrets, dirs_exist_ok=True)
            shutil.copytree(tls_dir(home), tls_dir(homes[side]), dirs_exist_ok=True)  # trusts Keycloak's CA
        probes = {side: root / f"stalls-{side}.json" if options.probe_stalls else None for side in PORTS}
        procs += start_gateway(trees["before"], homes["before"], PORTS["before"], env, probes["before"])
        procs += start_gateway(trees["after"], homes["after"], PORTS["after"], env, probes["after"])
        for side, port in PORTS.items():
            g.wait_for(f"http://127.0.0.1:{port}/healthz")
            g.wait_for(f"unix:{engine_socket(homes[side], 'main')}::/health")
        time.sleep(2)
        token = httpx.post(f"{settings.keycloak.issuer}/protocol/openid-connect/token",
                           data={"grant_type": "password", "client_id": "appliance-cli", "username": "admin",
                                 "password": secret(home, BOOTSTRAP_SECRET)},
                           verify=keycloak_ssl(settings, home)).json()["access_token"]
        headers = {"Authorization": f"Bearer {token}"}
        paths = {**{side: (f"http://127.0.0.1:{port}/v1/chat/completions", headers) for side, port in PORTS.items()},
                 **{f"stub_{side}": (f"unix:{engine_socket(homes[side], 'main')}::/v1/chat/completions", {})
                    for side in PORTS}}
        gateways = {"before": procs[1].pid, "after": procs[3].pid}
        rows = []
        for stream in (False, True):
            cpu_at_start = {name: g.cpu_seconds(pid) for name, pid in gateways.items()}
            load = load_prose if options.prose else g.load_interleaved
            samples = asyncio.run(load(paths, stream, options.requests))
            # CPU per request of each gateway process (the warm-up request included): less noisy than latency.
            cpu_ms = {name: round((g.cpu_seconds(pid) - cpu_at_start[name]) * 1000 / (options.requests + 1), 3)
                      for name, pid in gateways.items()}
            rows.append(row(stream, options.requests, samples, cpu_ms))
            print(json.dumps(rows[-1]), flush=True)
        if options.probe_stalls:
            for process in procs:
                process.terminate()
                process.wait(30)
            for side, probe in probes.items():
                print(side, probe.read_text() if probe and probe.exists() else "(no probe report)", flush=True)
        else:
            results = RESULTS.with_name("gateway_ab_prose.json") if options.prose else RESULTS
            results.write_text(json.dumps({"bench": "gateway_ab", "before": options.before,
                                           "after": options.after or "working tree", "prose": options.prose,
                                           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                           "rows": rows}, indent=1) + "\n")
    finally:
        for process in procs:
            process.terminate()
            process.wait(30)
        subprocess.run([g.APPLIANCE, "down"], env=env, capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
        for tree in {trees["before"], trees["after"]} - {PROJECT}:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=PROJECT, capture_output=True)


if __name__ == "__main__":
    main()
