"""Serving tiers, measured in one run on an appliance of its own: the demo model as
`assistant` in two tiers, `full` (two replicas) and `fast` (one), behind the gateway, with
embedded Keycloak; started here and taken down after.

(a) the response cache: a hit's latency against a miss's (the same requests, asked twice);
(b) interactive streamed requests on the full tier: time to first token p50/p95 with no batch,
    then while a batch of requests drains through the batch-worker (yielding to them);
(c) two replicas and prompts sharing long prefixes (five system prompts, interleaved): prefix
    affinity against round robin, vLLM's own prefix-cache hit rate and mean time to first token.

Prints the figures and writes bench/results/serving_tiers.json.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI

from appliance import batches
from appliance.engine_launch import engine_socket
from appliance.home import Home
from appliance.secrets import secret
from bench.own_appliance import cli, own_appliance
from installer.realm import BOOTSTRAP_SECRET
from tests.support.tiers import TWO_TIERS

RESULTS = Path(__file__).parent / "results" / "serving_tiers.json"
PORT = 18580
KEYCLOAK_PORT = 18590
CACHE_REQUESTS = 20
INTERACTIVE = 20
BATCH_REQUESTS = 80
PREFIXES = 5  # odd: round robin does not send a prefix to the same replica by accident
QUESTIONS = 8
QUESTION_TOPICS = ["card", "loan", "fees", "hours", "transfer", "savings", "mortgage", "fraud"]


class Bench:
    def __init__(self, home: Home) -> None:
        self.home = home
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{PORT}", timeout=600)
        self.token = ""
        self.refresh()

    def refresh(self) -> None:
        """A fresh access token of the bootstrap admin (they live minutes; each phase takes one)."""
        self.token = httpx.post(
            f"https://127.0.0.1:{KEYCLOAK_PORT}/realms/appliance/protocol/openid-connect/token",
            data={"grant_type": "password", "client_id": "appliance-cli", "username": "admin",
                  "password": secret(self.home, BOOTSTRAP_SECRET)},
            verify=str(self.home.root / "tls" / "ca.pem"), timeout=60).json()["access_token"]
        self.http.headers["Authorization"] = f"Bearer {self.token}"

    def chat(self, model: str, system: str, question: str, **fields: Any) -> float:
        """Seconds to the whole answer."""
        started = time.perf_counter()
        answer = self.http.post("/v1/chat/completions", json={
            "model": model, "max_tokens": 16, "temperature": 0, **fields,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
        answer.raise_for_status()
        return time.perf_counter() - started

    def ttft(self, model: str, system: str, question: str) -> float:
        """Seconds to the first streamed token."""
        started = time.perf_counter()
        body = {"model": model, "max_tokens": 16, "temperature": 0.7, "stream": True,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
        with self.http.stream("POST", "/v1/chat/completions", json=body) as answer:
            answer.raise_for_status()
            first = None
            for line in answer.iter_lines():
                if first is None and '"content":"' in line and '"content":""' not in line:
                    first = time.perf_counter() - started
        assert first is not None, "no token streamed"
        return first

    def cache(self) -> dict[str, Any]:
        self.refresh()
        system = "You are a terse assistant."
        misses = [self.chat("assistant:full", system, f"Cache bench question {index}?")
                  for index in range(CACHE_REQUESTS)]
        hits = [self.chat("assistant:full", system, f"Cache bench question {index}?")
                for index in range(CACHE_REQUESTS)]
        stats = self.http.get("/admin/cache").json()
        miss_ms, hit_ms = statistics.median(misses) * 1000, statistics.median(hits) * 1000
        return {"requests": CACHE_REQUESTS, "miss_ms_p50": round(miss_ms, 1), "hit_ms_p50": round(hit_ms, 2),
                "hit_over_miss": round(hit_ms / miss_ms, 4), "hit_rate": stats["hit_rate"]}

    def interactive(self, label: str) -> list[float]:
        self.refresh()
        return [self.ttft("assistant:full", f"Interactive session {label} {index}.", "Say hello.")
                for index in range(INTERACTIVE)]

    def batch_drain(self) -> dict[str, Any]:
        alone = self.interactive("alone")
        client = OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key=self.token, max_retries=0)
        rows = [json.dumps({"custom_id": f"b{index}", "method": "POST", "url": "/v1/chat/completions",
                            "body": {"model": "assistant", "max_tokens": 32,
                                     "messages": [{"role": "user", "content": f"Write about topic {index}."}]}})
                for index in range(BATCH_REQUESTS)]
        uploaded = client.files.create(file=("bench.jsonl", ("\n".join(rows) + "\n").encode()), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        while batches.get(self.home, batch.id, None).request_counts.completed < 2:
            time.sleep(0.2)
        draining = self.interactive("draining")
        during = batches.get(self.home, batch.id, None).request_counts.completed
        started = time.monotonic()
        while (done := batches.get(self.home, batch.id, None)).status not in ("completed", "failed", "cancelled"):
            time.sleep(1)
        assert done.status == "completed", done

        def quantiles(values: list[float]) -> dict[str, float]:
            cuts = statistics.quantiles(values, n=20)
            return {"p50_ms": round(statistics.median(values) * 1000, 1), "p95_ms": round(cuts[18] * 1000, 1)}

        without, with_batch = quantiles(alone), quantiles(draining)
        return {"interactive_requests": INTERACTIVE, "batch_requests": BATCH_REQUESTS,
                "batch_done_while_measuring": during, "ttft_without_batch": without, "ttft_with_batch": with_batch,
                "p50_ratio": round(with_batch["p50_ms"] / without["p50_ms"], 2),
                "p95_ratio": round(with_batch["p95_ms"] / without["p95_ms"], 2),
                "batch_finished_s_after_measuring": round(time.monotonic() - started, 1)}

    def prefix_counters(self) -> tuple[float, float]:
        """(queries, hits) of vLLM's prefix cache, in tokens, summed over the full tier's replicas."""
        queries = hits = 0.0
        for replica in ("full", "full_1"):
            transport = httpx.HTTPTransport(uds=str(engine_socket(self.home, replica)))
            with httpx.Client(transport=transport, base_url="http://engine", timeout=30) as engine:
                text = engine.get("/metrics").text
            queries += sum(float(v) for v in re.findall(r"^vllm:prefix_cache_queries_total\{[^}]*\} (\S+)", text,
                                                        re.M))
            hits += sum(float(v) for v in re.findall(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)", text, re.M))
        return queries, hits

    def routing(self, balance: str, seed: str) -> dict[str, Any]:
        self.refresh()
        self.http.put("/admin/routing/balance", json={"balance": balance}).raise_for_status()
        systems = [(f"[{seed} {prefix}] You are the assistant of a bank's help desk. " +
                    "Answer briefly and politely; never reveal account numbers or internal procedures. " * 12)
                   for prefix in range(PREFIXES)]
        queries, hits = self.prefix_counters()
        ttfts = [self.ttft("assistant:full", systems[prefix], f"A question about {QUESTION_TOPICS[question]}?")
                 for question in range(QUESTIONS) for prefix in range(PREFIXES)]
        queries_after, hits_after = self.prefix_counters()
        return {"requests": len(ttfts), "prefix_cache_hit_rate": round((hits_after - hits) /
                                                                       max(queries_after - queries, 1), 4),
                "ttft_mean_ms": round(statistics.mean(ttfts) * 1000, 1)}


def main() -> None:
    settings_in_env = {"APPLIANCE_GATEWAY__PORT": str(PORT), "APPLIANCE_KEYCLOAK__PORT": str(KEYCLOAK_PORT),
                       "APPLIANCE_KEYCLOAK__MANAGEMENT_PORT": "18591", "APPLIANCE_BATCH__POLL_S": "0.2"}
    with own_appliance("aps-", settings_in_env, settings_file=TWO_TIERS) as (home, env):
        started = time.monotonic()
        cli(env, "up")
        up_s = time.monotonic() - started
        bench = Bench(home)
        bench.chat("assistant:full", "warm up", "Hi")
        bench.ttft("assistant:fast", "warm up", "Hi")
        results = {"setup": {"up_s": round(up_s, 1), "tiers": {"full": 2, "fast": 1}, "engine": "vLLM CPU, demo model"},
                   "cache": bench.cache(), "batch": bench.batch_drain()}
        round_robin = bench.routing("round_robin", "rr")
        affinity = bench.routing("affinity", "aff")
        results["routing"] = {
            "workload": f"{PREFIXES} system prompts (~1.1k characters) x {QUESTIONS} questions, interleaved, "
                        "streamed one at a time, two replicas",
            "round_robin": round_robin, "affinity": affinity,
            "ttft_affinity_over_round_robin": round(affinity["ttft_mean_ms"] / round_robin["ttft_mean_ms"], 3)}
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
