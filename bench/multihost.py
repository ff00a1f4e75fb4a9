"""One model across two hosts: start time and decode tokens/s of a TP=2 pool whose
ranks are on two hosts (the head here, a worker in a network namespace joined by a veth pair),
against the same TP=2 pool on one host, in the same invocation.

- start: two hosts, from `appliance join` on the worker (weights pulled from the head) until
  the head's controller says the pool serves; one host, `appliance up` until the engine answers;
- tokens/s: CONCURRENCY streams of MAX_TOKENS greedy tokens (ignore_eos), ROUNDS rounds, sent to
  each head engine's socket directly (the gateway is the same for both and measured elsewhere).

The model is the tiny Llama of tests/integration/test_cluster.py (4 heads of 64, TP=2), on the
CPU engine: the ratio shows what crossing hosts costs the ranks' collectives on this machine (a
veth pair; real hosts add the network's latency).

Run from the checkout: .venv/bin/python -m bench.multihost   (as root: it makes a network namespace)
Writes bench/results/multihost.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx

from appliance.engine_launch import engine_socket
from appliance.home import Home
from appliance.secrets import secret
from tests.support.appliances import APPLIANCE, Appliance, make_appliance
from tests.support.models import tiny_llama_for_two_ranks
from tests.support.netns import veth_namespace
from tests.support.ports import free_port

RESULTS = Path(__file__).parent / "results" / "multihost.json"
POOL = "mh"
MAX_TOKENS = 64
CONCURRENCY = 4
ROUNDS = 3
START_TIMEOUT_S = 900


def tokens_per_s(home: Home, model: str) -> float:
    """Decode tokens/s over ROUNDS rounds of CONCURRENCY greedy streams, straight to the engine."""
    key = secret(home, "engine-api-key")
    body = {"model": model, "prompt": "The history of the lighthouse", "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}
    transport = httpx.HTTPTransport(uds=str(engine_socket(home, POOL)))
    with httpx.Client(transport=transport, base_url="http://engine", timeout=300,
                      headers={"Authorization": f"Bearer {key}"}) as client:
        client.post("/v1/completions", json=body | {"max_tokens": 4}).raise_for_status()  # warm-up

        def one(_: int) -> int:
            answer = client.post("/v1/completions", json=body)
            answer.raise_for_status()
            return int(answer.json()["usage"]["completion_tokens"])

        started, produced = time.monotonic(), 0
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            for _ in range(ROUNDS):
                produced += sum(pool.map(one, range(CONCURRENCY)))
        return produced / (time.monotonic() - started)


def pool_settings(model: Path, **extra: str) -> str:
    lines = [f"{key} = {value}" for key, value in extra.items()]
    return f'[[pools]]\nname = "{POOL}"\nmodel = "{model}"\n' + "\n".join(lines) + "\n"


def two_hosts(model: Path, work: Path) -> dict[str, float]:
    profile = work / "profile.json"
    profile.write_text(json.dumps({"hosts": [{"name": name, "gpus": [{"index": 0, "name": "L4",
                                                                        "memory_bytes": 24 * 2**30}]}
                                             for name in ("head", "worker-1")]}))
    worker_home = work / "w"
    with veth_namespace() as net, appliance() as head:
        plan = head.run("plan", str(model), "--profile", str(profile), "--tp", "2", "--context", "1024",
                        "--pool", POOL, "--json")
        (work / "plan.json").write_text(plan.stdout)
        port = free_port()
        head.home.settings_file.write_text(f'[cluster]\nbind = "{net.head}"\nport = {port}\n\n'
                                           + pool_settings(model, plan=f'"{work / "plan.json"}"'))
        assert head.run("up").returncode == 0
        token = head.run("hosts", "add", "worker-1").stdout
        env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")} | {
            "APPLIANCE_HOME": str(worker_home)}
        worker = ["ip", "netns", "exec", net.namespace, APPLIANCE]
        started = time.monotonic()
        try:
            joined = subprocess.run([*worker, "join", f"https://{net.head}:{port}"], input=token, env=env,
                                    capture_output=True, text=True, cwd="/")
            assert joined.returncode == 0, joined.stderr
            state = head.home.run / "cluster" / f"{POOL}.json"
            while not json.loads(state.read_text())["ready"]:
                assert time.monotonic() - started < START_TIMEOUT_S, state.read_text()
                time.sleep(0.5)
            start_s = time.monotonic() - started
            return {"start_s": round(start_s, 1), "tokens_per_s": round(tokens_per_s(head.home, model.name), 1)}
        finally:
            subprocess.run([*worker, "down"], env=env, capture_output=True, cwd="/")


def one_host(model: Path) -> dict[str, float]:
    with appliance() as one:
        one.home.settings_file.write_text(pool_settings(model, tensor_parallel_size="2", max_model_len="1024"))
        started = time.monotonic()
        up = one.run("up")
        assert up.returncode == 0, up.stdout + up.stderr
        start_s = time.monotonic() - started
        return {"start_s": round(start_s, 1), "tokens_per_s": round(tokens_per_s(one.home, model.name), 1)}


@contextmanager
def appliance() -> Iterator[Appliance]:
    """A fresh appliance (no Keycloak: the engines are measured), brought down after."""
    made = make_appliance(None)
    try:
        yield next(made)
    finally:
        made.close()


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="multihost-") as scratch:
        work = Path(scratch)
        demo = Home.from_env().demo_model
        model = tiny_llama_for_two_ranks(work / "tiny-llama", demo)
        one = one_host(model)
        two = two_hosts(model, work)
    result = {"model": "tiny Llama (2 layers, 4 heads of 64), TP=2, CPU engine, float32",
              "concurrency": CONCURRENCY, "max_tokens": MAX_TOKENS, "rounds": ROUNDS,
              "one_host": one, "two_hosts": two,
              "start_ratio": round(two["start_s"] / one["start_s"], 2),
              "tokens_per_s_ratio": round(two["tokens_per_s"] / one["tokens_per_s"], 2)}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
