"""Pools spanning hosts in the gateway's /metrics, from the state their controller writes: whether
each serves, each worker host's rank, and how long since its heartbeat (which keeps growing when
the controller itself stops writing)."""

from __future__ import annotations

import os
import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from appliance.durable import replace_file
from appliance.home import Home
from appliance.hosts import ClusterPoolState, RankView, cluster_state_file
from serve.metrics import ClusterCollector


def scraped(home: Home) -> dict[tuple[str, ...], float]:
    registry = CollectorRegistry()
    registry.register(ClusterCollector(home, ["big", "torn", "linked", "gone"]))
    return {(sample.name, *(sample.labels[name] for name in ("pool", "host") if name in sample.labels)): sample.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for sample in family.samples}


def written(home: Home, pool: str, ready: bool, ranks: list[RankView], written_s_ago: float = 0.0) -> None:
    path = cluster_state_file(home, pool)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = ClusterPoolState(pool=pool, epoch=3, ready=ready, why="serving" if ready else "waiting for w2",
                             ranks=[RankView(host="head", node=0, running=True, pid=10, epoch=3), *ranks])
    replace_file(path, state.model_dump_json().encode(), mode=0o644)
    stamp = time.time() - written_s_ago
    os.utime(path, (stamp, stamp))


def test_each_worker_hosts_rank_and_heartbeat_age_with_the_pools_readiness(home: Home) -> None:
    assert scraped(home) == {}, "no pool spans hosts: no series, and no error"
    written(home, "big", False, [RankView(host="w1", node=1, running=True, pid=7, epoch=3, seen_s_ago=0.4),
                                 RankView(host="w2", node=2, running=False, pid=0, epoch=0)], written_s_ago=100)
    cluster_state_file(home, "torn").write_text("{not json")  # half a write: skipped, never a failed scrape
    cluster_state_file(home, "linked").symlink_to("/dev/zero")  # never followed, never read for ever
    written(home, "left", False, [RankView(host="w9", node=1, running=False, pid=0, epoch=0, seen_s_ago=1)])
    found = scraped(home)
    assert found[("appliance_cluster_pool_ready", "big")] == 0
    assert found[("appliance_cluster_rank_running", "big", "w1")] == 1
    assert found[("appliance_cluster_rank_running", "big", "w2")] == 0
    assert 100 < found[("appliance_cluster_heartbeat_age_seconds", "big", "w1")] < 110, "the controller went quiet"
    assert ("appliance_cluster_heartbeat_age_seconds", "big", "w2") not in found, "never heard from: no age made up"
    assert not any("head" in key for key in found), "the head's own rank is not a worker host"
    assert not any(key[1] in ("torn", "linked", "left") for key in found), "only whole files of pools planned now"
