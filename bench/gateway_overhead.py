"""Gateway overhead: the same load straight to an engine and through the gateway (auth on).

Three sections, each in one run against one appliance (real Keycloak, real token validation and
introspection), each comparing paths to the same engine: direct, through a bare proxy
(bench/bare_proxy.py: uvicorn in, aiohttp out, nothing else; what this machine charges for a
Python hop at all) and through the gateway; the stub sections add the bare proxy with one
fdatasync per request before the response ends (the audit log's durability rule at its barest):
- vllm: the vLLM CPU engine;
- stub: a stand-in engine that answers at once (bench/stub_engine.py) with a second gateway in
  front of it, which isolates the gateway's own added latency and throughput limit;
- stub_idle: the same stand-in answering after 0.4 s, about as long as the CPU engine takes
  (concurrency 1 only): the gateway then idles between its two bursts of work per request, and
  on this VM work done right after idling costs many times more than back to back
  (bench/idle_penalty.py), which the stub section's back-to-back requests never see;
- tls: the stand-in engine behind two gateways, one on plain HTTP and one on HTTPS (its
  certificate from the appliance's CA, each client keeping its connection as the official
  clients do), paths taking turns: what TLS adds to the gateway (`tls_added_p50_ms`).

For concurrency 1 the paths take turns request by request; for 8 and 32 they take turns run by
run (ROUNDS each); streamed and not; so drift hits every path alike. Reports p50/p99 of each
path and, for every path but direct, the added p50 with a bootstrap 95 % confidence
interval (how far the engine's own noise leaves the difference uncertain), the added p99 and the
throughput ratio (path / direct). The stub section also reports the gateway's CPU time per
request (less sensitive to load than latency, though a slower phase of this shared VM raises it
too).

Run: .venv/bin/python bench/gateway_overhead.py [--sections vllm,stub,stub_idle,tls]
(needs ./bootstrap.sh --no-start first). Writes bench/results/gateway_overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from appliance.engine_launch import engine_socket
from appliance.home import HOME_ENV, Home
from appliance.secrets import secret
from appliance.settings import load_settings
from appliance.tls import keycloak_ssl
from installer.keycloak_dist import install_dir
from installer.realm import BOOTSTRAP_SECRET

RESULTS = Path(__file__).parent / "results" / "gateway_overhead.json"
APPLIANCE = str(Path(sys.executable).with_name("appliance"))
MODEL = "SmolLM2-135M-Instruct"
REQUESTS_PER_WORKER = {"vllm": {1: 60, 8: 4, 32: 1}, "stub": {1: 600, 8: 100, 32: 40}, "stub_idle": {1: 60},
                       "tls": {1: 600, 8: 100}}
STUB_IDLE_DELAY_S = 0.4
ROUNDS = 3
BOOTSTRAP_RESAMPLES = 2000
PORTS = {"gateway": 18480, "stub_gateway": 18481, "stub_gateway_tls": 18484,
         "bare_proxy": 18482, "bare_proxy_durable": 18483, "keycloak": 18490, "keycloak_management": 18491}
CA_FILE = "BENCH_GATEWAY_CA"  # where the tls section's clients find the CA (set by tls_section)
LOGS = Path(tempfile.gettempdir())  # what the helper servers said, kept if a run fails


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def added_p50_ci95(direct: list[float], gateway: list[float]) -> tuple[float, float]:
    """Bootstrap 95 % interval of p50(gateway) - p50(direct), in seconds."""
    rng = random.Random(0)
    differences = sorted(percentile(rng.choices(gateway, k=len(gateway)), 0.5)
                         - percentile(rng.choices(direct, k=len(direct)), 0.5)
                         for _ in range(BOOTSTRAP_RESAMPLES))
    return percentile(differences, 0.025), percentile(differences, 0.975)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one(client: httpx.AsyncClient, url: str, headers: dict[str, str], stream: bool) -> float:
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


def http_client(url: str, **options: Any) -> tuple[httpx.AsyncClient, str]:
    """A client for `url` and the URL to ask: `unix:SOCKET::PATH` reaches an engine over its Unix
    socket (engines listen on no TCP port), anything else as it is."""
    if url.startswith("unix:"):
        socket, _, path = url[len("unix:"):].partition("::")
        return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=socket), **options), f"http://engine{path}"
    if url.startswith("https:"):  # the tls section's gateway: its certificate from the CA in CA_FILE
        return httpx.AsyncClient(verify=ssl.create_default_context(cafile=os.environ[CA_FILE]), **options), url
    return httpx.AsyncClient(**options), url


async def load(url: str, headers: dict[str, str], concurrency: int, stream: bool,
               per_worker: int) -> tuple[list[float], float]:
    """Latencies of every request and requests/s, `concurrency` workers in parallel."""
    limits = httpx.Limits(max_connections=concurrency * 2)
    http, url = http_client(url, timeout=300, limits=limits)
    async with http as client:
        await one(client, url, headers, stream)  # warm the connection
        latencies: list[float] = []

        async def worker() -> None:
            for _ in range(per_worker):
                latencies.append(await one(client, url, headers, stream))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, len(latencies) / (time.perf_counter() - started)


def start_appliance() -> tuple[Path, dict[str, str]]:
    root = Path(tempfile.mkdtemp(prefix="apg-", dir="/tmp"))
    root.chmod(0o711)  # PostgreSQL's user passes through to its own directory
    home = Home(root / "h").ensure()
    default = Home.from_env()
    home.demo_model.symlink_to(default.demo_model, target_is_directory=True)
    shutil.copytree(install_dir(default), install_dir(home), symlinks=True,
                    ignore=shutil.ignore_patterns("h2", "tmp"))
    env = {**os.environ, HOME_ENV: str(home.root), "APPLIANCE_GATEWAY__PORT": str(PORTS["gateway"]),
           "APPLIANCE_KEYCLOAK__PORT": str(PORTS["keycloak"]),
           "APPLIANCE_KEYCLOAK__MANAGEMENT_PORT": str(PORTS["keycloak_management"]),
           "APPLIANCE_KEYCLOAK__POSTGRES_PORT": str(PORTS["keycloak"] + 2),
           # The bench measures overhead, not the limiter: give the admin a budget it never meets.
           "APPLIANCE_GATEWAY__LIMITS": ("{ admin = { requests_per_minute = 10000000, tokens_per_minute = 1000000000, "
                                         "max_concurrent = 10000 } }")}
    started = subprocess.run([APPLIANCE, "up"], env=env, capture_output=True, text=True)
    if started.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        raise SystemExit(f"appliance up failed: {started.stderr.strip()}")
    return root, env


Headers = Callable[[], dict[str, str]]


async def load_interleaved(paths: dict[str, tuple[str, dict[str, str]]], stream: bool,
                           requests: int) -> dict[str, list[float]]:
    """Concurrency 1 on every path, the paths taking turns request by request (in a fresh random
    order each turn), so the engine's and the machine's drift hits every path alike."""
    rng = random.Random(1)
    order = list(paths)
    latencies: dict[str, list[float]] = {name: [] for name in paths}
    async with contextlib.AsyncExitStack() as stack:
        clients, urls = {}, {}
        for name, (url, headers) in paths.items():
            http, urls[name] = http_client(url, timeout=300)
            clients[name] = await stack.enter_async_context(http)
            await one(clients[name], urls[name], headers, stream)  # warm the connection
        for _ in range(requests):
            rng.shuffle(order)
            for name in order:
                latencies[name].append(await one(clients[name], urls[name], paths[name][1], stream))
    return latencies


def measure(paths: dict[str, tuple[str, Headers]], per_worker: dict[int, int],
            gateway_pid: int | None = None) -> list[dict[str, Any]]:
    """Rows of p50/p99/rps per path, and for each path but `direct` its added p50 (with a
    bootstrap 95 % interval), added p99 and throughput ratio, for each load shape (stream or
    not, each concurrency in `per_worker` with its requests per worker). Concurrency 1
    interleaves the paths request by request; higher concurrency runs each path in turn, ROUNDS
    times. With `gateway_pid`, also the gateway process's CPU time per request."""
    rows = []
    for stream in (False, True):
        for concurrency, requests in per_worker.items():
            samples: dict[str, list[float]] = {name: [] for name in paths}
            rates: dict[str, list[float]] = {name: [] for name in paths}
            cpu_before = cpu_seconds(gateway_pid) if gateway_pid else 0.0
            if concurrency == 1:
                fixed = {name: (url, headers()) for name, (url, headers) in paths.items()}
                samples = asyncio.run(load_interleaved(fixed, stream, requests))
                rates = {name: [len(values) / sum(values)] for name, values in samples.items()}
                warm_ups = 1
            else:
                for _ in range(ROUNDS):
                    for name, (url, headers) in paths.items():
                        latencies, rate = asyncio.run(load(url, headers(), concurrency, stream, requests))
                        samples[name] += latencies
                        rates[name].append(rate)
                warm_ups = ROUNDS
            gateway_cpu_s = cpu_seconds(gateway_pid) - cpu_before if gateway_pid else 0.0
            row: dict[str, Any] = {"stream": stream, "concurrency": concurrency, "requests": len(samples["gateway"])}
            for name in paths:
                row[f"{name}_p50_ms"] = round(percentile(samples[name], 0.5) * 1000, 2)
                row[f"{name}_p99_ms"] = round(percentile(samples[name], 0.99) * 1000, 2)
                row[f"{name}_rps"] = round(statistics.mean(rates[name]), 2)
            for name in paths:
                if name != "direct":
                    # The gateway's figures keep their plain names; other paths' are prefixed.
                    prefix = "" if name == "gateway" else f"{name}_"
                    row[f"{prefix}added_p50_ms"] = round(row[f"{name}_p50_ms"] - row["direct_p50_ms"], 2)
                    low, high = added_p50_ci95(samples["direct"], samples[name])
                    row[f"{prefix}added_p50_ci95_ms"] = [round(low * 1000, 2), round(high * 1000, 2)]
                    row[f"{prefix}added_p99_ms"] = round(row[f"{name}_p99_ms"] - row["direct_p99_ms"], 2)
                    row[f"{prefix}throughput_ratio"] = round(row[f"{name}_rps"] / row["direct_rps"], 3)
            if gateway_pid:
                served = len(samples["gateway"]) + warm_ups
                row["gateway_cpu_ms_per_request"] = round(gateway_cpu_s / served * 1000, 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def wait_for(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if asyncio.run(_status(url)) == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


async def _status(url: str) -> int:
    http, url = http_client(url, timeout=2)
    async with http:
        return (await http.get(url)).status_code


def serve(app: str, port: int | Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """An ASGI app from this repository under uvicorn on a loopback port (or a Unix socket)."""
    where = ["--uds", str(port)] if isinstance(port, Path) else ["--port", str(port)]
    return _start([sys.executable, "-P", "-m", "uvicorn", app, *where, "--no-access-log", "--log-level", "warning"],
                  port, env)


def _start(command: list[str], port: int | Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    name = port.name if isinstance(port, Path) else port
    log = (LOGS / f"gateway-overhead-{name}.log").open("w")
    return subprocess.Popen(command, cwd=Path(__file__).parent.parent, env=env, stdout=subprocess.DEVNULL, stderr=log)


@contextlib.contextmanager
def bare_proxy(target: str, port: int, durable_file: Path | None = None) -> Iterator[str]:
    """bench/bare_proxy.py in front of `target` (appending and fdatasync'ing a line to
    `durable_file` per request, if given); yields its chat completions URL."""
    env = {**os.environ, "BARE_PROXY_TARGET": target}
    if durable_file is not None:
        env["BARE_PROXY_DURABLE_FILE"] = str(durable_file)
    proxy = serve("bench.bare_proxy:app", port, env)
    try:
        wait_for(f"http://127.0.0.1:{port}/health")
        yield f"http://127.0.0.1:{port}/v1/chat/completions"
    finally:
        proxy.terminate()
        proxy.wait(30)


def stub_engine(env: dict[str, str], delay_s: float) -> tuple[Home, str, subprocess.Popen[bytes]]:
    """The stand-in engine, on the Unix socket of a state dir of its own (the realm's secrets and
    the CA copied), where a gateway started for that state dir finds it instead of the vLLM."""
    appliance = Home(Path(env[HOME_ENV]))
    home = Home(appliance.root.with_name("stub")).ensure()
    shutil.copytree(appliance.secrets, home.secrets, dirs_exist_ok=True)
    shutil.copytree(appliance.root / "tls", home.root / "tls", dirs_exist_ok=True)
    socket = engine_socket(home, "main")
    socket.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    socket.unlink(missing_ok=True)
    # STUB_ENGINE_DELAY_S: see stub_engine.py
    stub = serve("bench.stub_engine:app", socket, {**os.environ, "STUB_ENGINE_DELAY_S": str(delay_s)})
    return home, f"unix:{socket}", stub


def stub_gateway(env: dict[str, str], home: Home, port: int, **settings: str) -> subprocess.Popen[bytes]:
    """A gateway for the stand-in engine, as supervisord runs it (serve.listener), settings from
    the environment."""
    return _start([sys.executable, "-P", "-m", "serve.listener"], port,
                  {**env, HOME_ENV: str(home.root), "APPLIANCE_POOLS__MAIN__SERVED_MODEL_NAME": MODEL,
                   "APPLIANCE_GATEWAY__PORT": str(port), **settings})


def tls_section(env: dict[str, str], token: Headers, per_worker: dict[int, int]) -> list[dict[str, Any]]:
    """The stand-in engine behind a plain gateway and an HTTPS one (loopback, tls = on)."""
    home, stub_url, stub = stub_engine(env, 0.0)
    plain = stub_gateway(env, home, PORTS["stub_gateway"])
    https = stub_gateway(env, home, PORTS["stub_gateway_tls"], APPLIANCE_GATEWAY__TLS="on")
    os.environ[CA_FILE] = str(home.root / "tls" / "ca.pem")
    try:
        wait_for(f"{stub_url}::/health")
        wait_for(f"http://127.0.0.1:{PORTS['stub_gateway']}/healthz")
        wait_for(f"https://127.0.0.1:{PORTS['stub_gateway_tls']}/healthz")
        rows = measure({
            "direct": (f"{stub_url}::/v1/chat/completions", dict),
            "gateway": (f"http://127.0.0.1:{PORTS['stub_gateway']}/v1/chat/completions", token),
            "gateway_tls": (f"https://127.0.0.1:{PORTS['stub_gateway_tls']}/v1/chat/completions", token),
        }, per_worker)
        for row in rows:
            row["tls_added_p50_ms"] = round(row["gateway_tls_p50_ms"] - row["gateway_p50_ms"], 2)
            row["tls_throughput_ratio"] = round(row["gateway_tls_rps"] / row["gateway_rps"], 3)
        return rows
    finally:
        for process in (https, plain, stub):
            process.terminate()
            process.wait(30)


def stub_section(env: dict[str, str], token: Headers, per_worker: dict[int, int],
                 delay_s: float = 0.0) -> list[dict[str, Any]]:
    """A stand-in engine answering after `delay_s`, the bare proxy (also with one fdatasync per
    request) and a second gateway in front of it (same realm, same settings)."""
    home, stub_url, stub = stub_engine(env, delay_s)
    gateway = stub_gateway(env, home, PORTS["stub_gateway"])
    try:
        wait_for(f"{stub_url}::/health")
        wait_for(f"http://127.0.0.1:{PORTS['stub_gateway']}/healthz")
        durable_file = Path(env[HOME_ENV]) / "bare-proxy-durable.log"  # on the audit log's disk
        with (bare_proxy(stub_url, PORTS["bare_proxy"]) as proxied,
              bare_proxy(stub_url, PORTS["bare_proxy_durable"], durable_file) as proxied_durable):
            return measure({
                "direct": (f"{stub_url}::/v1/chat/completions", dict),
                "bare_proxy": (proxied, dict),
                "bare_proxy_durable": (proxied_durable, dict),
                "gateway": (f"http://127.0.0.1:{PORTS['stub_gateway']}/v1/chat/completions", token),
            }, per_worker, gateway_pid=None if delay_s else gateway.pid)  # idle, its timers' CPU would count
    finally:
        for process in (gateway, stub):
            process.terminate()
            process.wait(30)


def main() -> None:
    # Unwind on SIGTERM/SIGINT so `finally` runs `appliance down` (a background job started by a
    # non-interactive shell inherits SIGINT ignored; Python's default SIGTERM does not unwind).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="vllm,stub,stub_idle,tls",
                        help="comma-separated: vllm, stub, stub_idle, tls")
    sections = [s for s in parser.parse_args().sections.split(",") if s]
    root, env = start_appliance()
    home = Home(Path(env[HOME_ENV]))
    results = json.loads(RESULTS.read_text()).get("sections", {}) if RESULTS.exists() else {}
    try:
        settings = load_settings(home.settings_file, environ=env)
        def token() -> dict[str, str]:
            """A fresh admin token for each run: access tokens live five minutes."""
            body = httpx.post(f"{settings.keycloak.issuer}/protocol/openid-connect/token",
                              data={"grant_type": "password", "client_id": "appliance-cli",
                                    "username": "admin", "password": secret(home, BOOTSTRAP_SECRET)},
                              verify=keycloak_ssl(settings, home)).json()
            return {"Authorization": f"Bearer {body['access_token']}"}

        engine_key = {"Authorization": f"Bearer {secret(home, 'engine-api-key')}"}
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        if "vllm" in sections:
            engine_url = f"unix:{engine_socket(home, 'main')}"
            with bare_proxy(engine_url, PORTS["bare_proxy"]) as proxied:
                rows = measure({
                    "direct": (f"{engine_url}::/v1/chat/completions", lambda: engine_key),
                    "bare_proxy": (proxied, lambda: engine_key),
                    "gateway": (f"http://127.0.0.1:{PORTS['gateway']}/v1/chat/completions", token),
                }, REQUESTS_PER_WORKER["vllm"])
            results["vllm"] = {"time": stamp, "rows": rows}
        if "stub" in sections:
            results["stub"] = {"time": stamp, "rows": stub_section(env, token, REQUESTS_PER_WORKER["stub"])}
        if "stub_idle" in sections:
            results["stub_idle"] = {"time": stamp, "delay_s": STUB_IDLE_DELAY_S,
                                    "rows": stub_section(env, token, REQUESTS_PER_WORKER["stub_idle"],
                                                         STUB_IDLE_DELAY_S)}
        if "tls" in sections:
            results["tls"] = {"time": stamp, "rows": tls_section(env, token, REQUESTS_PER_WORKER["tls"])}
    finally:
        subprocess.run([APPLIANCE, "down"], env=env, capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
    result = {"bench": "gateway_overhead", "host_cpus": len(os.sched_getaffinity(0)),
              "note": "engine, gateway and load generator share 2 cores; max_tokens=4; auth with "
                      "Keycloak token validation and introspection (10 s cache)",
              "sections": results}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
