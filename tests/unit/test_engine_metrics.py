"""The engines' metrics relay: every replica's samples in one exposition, each labelled with its
pool, replica and tier (an engine's own label of those names replaced); a replica that does not
answer, or answers with something that is not an exposition, shows as appliance_engine_scrape_up 0."""

from __future__ import annotations

import asyncio
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import aiohttp
import aiohttp.abc
from aiohttp.abc import ResolveResult
from prometheus_client.parser import text_string_to_metric_families

from serve.engine_metrics import MAX_BYTES, EngineMetricsRelay, relabelled
from serve.replicas import Pool, Replica

VLLM = """# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="demo"} {waiting}
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="demo",pool="spoofed"} {tokens}
"""


def exposition(waiting: int, tokens: int) -> str:
    return VLLM.replace("{waiting}", str(waiting)).replace("{tokens}", str(tokens))


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode()) for s in family.samples}


def test_every_replica_is_labelled_and_a_silent_one_is_down() -> None:
    main = Pool("main", "demo", (Replica("main", Path("/x/main")), Replica("main_1", Path("/x/main_1"))))
    fast = Pool("fast", "demo", (Replica("fast", Path("/x/fast")),), tier="fast")
    found = samples(relabelled([(main, main.replicas[0], exposition(2, 10)),
                                (main, main.replicas[1], exposition(0, 7)),
                                (fast, fast.replicas[0], None)]))
    where = {"main": (("pool", "main"), ("replica", "main"), ("tier", "")),
             "main_1": (("pool", "main"), ("replica", "main_1"), ("tier", "")),
             "fast": (("pool", "fast"), ("replica", "fast"), ("tier", "fast"))}
    for replica, up in (("main", 1.0), ("main_1", 1.0), ("fast", 0.0)):
        assert found[("appliance_engine_scrape_up", where[replica])] == up
    waiting = {k: v for k, v in found.items() if k[0] == "vllm:num_requests_waiting"}
    assert sorted(waiting.values()) == [0.0, 2.0] and len(waiting) == 2
    tokens = [dict(k[1]) for k in found if k[0] == "vllm:generation_tokens_total"]
    assert sorted(t["replica"] for t in tokens) == ["main", "main_1"]
    assert all(t["pool"] == "main" for t in tokens), "an engine's own label of the relay's name is replaced"


def test_an_answer_that_is_no_exposition_counts_as_none() -> None:
    pool = Pool("main", "demo", (Replica("main", Path("/x/main")),))
    found = samples(relabelled([(pool, pool.replicas[0], "<html>not metrics {{{</html>\n")]))
    assert found == {("appliance_engine_scrape_up", (("pool", "main"), ("replica", "main"), ("tier", ""))): 0.0}


def test_only_the_engines_own_families_pass_safe_and_without_timestamps() -> None:
    """A hostile engine: it poses as the gateway's metrics, names the adapters in use, stamps a
    sample beyond Prometheus's range, and puts an escape sequence in a label."""
    pool = Pool("main", "demo", (Replica("main", Path("/x/main")),))
    hostile = (exposition(1, 5)
               + "# TYPE gateway_audit_writable gauge\ngateway_audit_writable 0\n"
               + '# TYPE vllm:lora_requests_info gauge\nvllm:lora_requests_info{running_lora_adapters="secret-v3"} 1\n'
               + '# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{model="/srv/models/secret"} 1\n'
               + '# TYPE vllm:kv_cache_usage_perc gauge\n'
               + 'vllm:kv_cache_usage_perc{engine="\\u001b]52;c;evil\\u0007' + "x" * 500
               + '"} 0.5 99999999999999999999\n')
    text = relabelled([(pool, pool.replicas[0], hostile.replace("\\u001b", "\x1b").replace("\\u0007", "\x07"))])
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}
    assert "gateway_audit_writable" not in families and "vllm:lora_requests_info" not in families
    assert "vllm:cache_config_info" not in families, "configuration as labels stays with the engine"
    [kv] = families["vllm:kv_cache_usage_perc"].samples
    assert kv.timestamp is None and "\x1b" not in kv.labels["engine"] and "\x07" not in kv.labels["engine"]
    assert len(kv.labels["engine"]) <= 200


class Engine(BaseHTTPRequestHandler):
    """An engine's /metrics as a test sets it: body and content type."""

    body = b""
    content_type = "text/plain; version=0.0.4"
    asked = 0

    def do_GET(self) -> None:
        type(self).asked += 1
        self.send_response(200)
        self.send_header("Content-Type", self.content_type)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


def relay_over(engines: list[type[Engine]]) -> tuple[bytes, bytes]:
    """Two expositions in a row from a relay over engines served on loopback TCP (the socket does
    not matter to the relay: its sessions reach the engines)."""
    servers = [HTTPServer(("127.0.0.1", 0), engine) for engine in engines]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    replicas = tuple(Replica(f"main_{i}", Path(f"/x/{i}")) for i in range(len(engines)))
    pool = Pool("main", "demo", replicas)

    async def scrape() -> tuple[bytes, bytes]:
        sessions = {}
        for replica, server in zip(replicas, servers, strict=True):
            resolver = StaticResolver({"engine": server.server_address[1]})
            sessions[replica.name] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(resolver=resolver))
        relay = EngineMetricsRelay([pool], sessions, {})
        try:
            return await relay.exposition(), await relay.exposition()
        finally:
            for session in sessions.values():
                await session.close()

    try:
        return asyncio.run(scrape())
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


class StaticResolver(aiohttp.abc.AbstractResolver):
    """`engine` (the relay's host name) is 127.0.0.1 at the given port."""

    def __init__(self, ports: dict[str, int]) -> None:
        self.ports = ports

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET) -> list[ResolveResult]:
        return [ResolveResult(hostname=host, host="127.0.0.1", port=self.ports[host], family=socket.AF_INET,
                              proto=0, flags=0)]

    async def close(self) -> None:
        pass


def test_a_bad_charset_or_a_huge_answer_is_that_replica_down_and_scrapes_are_reused() -> None:
    good: type[Engine] = type("Good", (Engine,), {"body": exposition(3, 9).encode(), "asked": 0})
    odd = type("Odd", (Engine,), {"body": exposition(1, 1).encode(), "content_type": "text/plain; charset=hex"})
    huge = type("Huge", (Engine,), {"body": b"# " + b"x" * (MAX_BYTES + 10) + b"\n"})
    first, second = relay_over([good, odd, huge])
    up = {dict(k[1])["replica"]: v for k, v in samples(first).items() if k[0] == "appliance_engine_scrape_up"}
    assert up == {"main_0": 1.0, "main_1": 1.0, "main_2": 0.0}, "a charset it claims is ignored: UTF-8"
    assert second == first and good.asked == 1, "a second scrape within REUSE_S reuses the first"
