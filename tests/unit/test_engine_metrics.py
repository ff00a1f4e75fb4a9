"""The engines' metrics relay: every replica's samples in one exposition, each labelled with its
pool, replica and tier (an engine's own label of those names replaced); a replica that does not
answer, or answers with something that is not an exposition, shows as appliance_engine_scrape_up 0."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from serve.engine_metrics import relabelled
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
