"""Tiers by name and by the routing policy; replicas by load and prompt-prefix affinity
with a load bound; round robin for comparison."""

from __future__ import annotations

import pytest

from appliance.settings import RoutingSettings
from serve.errors import GatewayError
from serve.router import Balancer, pick_tier, prefix_chain, split_model

TIERS = {"fast": "fast-pool", "full": "full-pool"}
POLICY = RoutingSettings(long_prompt_chars=100)


def test_a_tier_is_asked_for_by_name_or_chosen_by_the_policy() -> None:
    assert split_model("assistant:fast", {"assistant"}) == ("assistant", "fast")
    assert split_model("assistant", {"assistant"}) == ("assistant", None)
    assert split_model("odd:name", {"odd:name"}) == ("odd:name", None)  # a served name with ':' is itself
    assert pick_tier("a", TIERS, "full", stream=True, prompt_chars=1, policy=POLICY) == "full-pool"
    assert pick_tier("a", TIERS, None, stream=True, prompt_chars=10, policy=POLICY) == "fast-pool"
    assert pick_tier("a", TIERS, None, stream=True, prompt_chars=101, policy=POLICY) == "full-pool"  # long context
    assert pick_tier("a", TIERS, None, stream=False, prompt_chars=10, policy=POLICY) == "full-pool"  # not interactive
    no_fast = RoutingSettings(interactive_tier=None)
    assert pick_tier("a", TIERS, None, stream=True, prompt_chars=1, policy=no_fast) == "full-pool"
    assert pick_tier("a", {None: "only"}, None, stream=True, prompt_chars=1, policy=POLICY) == "only"
    assert pick_tier("a", {"gold": "g", "tin": "t"}, None, stream=False, prompt_chars=1, policy=POLICY) == "g"
    with pytest.raises(GatewayError, match=r"model 'a' has no tier 'huge'; models available to you: a, a:fast, "
                       r"a:full$") as missing:
        pick_tier("a", TIERS, "huge", stream=False, prompt_chars=1, policy=POLICY)
    assert (missing.value.status, missing.value.code) == (404, "model_not_found")


def test_prefix_chains_share_their_common_blocks() -> None:
    one = prefix_chain("A" * 40 + "tail one", 16, 64)
    two = prefix_chain("A" * 40 + "another tail", 16, 64)
    assert one[:2] == two[:2] and one[2] != two[2]
    assert len(prefix_chain("x" * 10_000, 16, 4)) == 4  # bounded
    assert prefix_chain("\ud800 lone surrogate", 16, 4)  # any string hashes


def test_affinity_sends_a_shared_prefix_back_to_its_replica_within_the_load_bound() -> None:
    balancer = Balancer(["r0", "r1"], RoutingSettings(affinity_block_bytes=16, affinity_max_skew=1))
    ready = {"r0", "r1"}
    system = "You are a careful assistant. " * 4
    first = balancer.choose(system + "question one", ready)
    assert first.reason == "least_loaded"
    balancer.started(first.replica)
    again = balancer.choose(system + "question two", ready)
    assert again.replica == first.replica and again.reason == "affinity"
    balancer.started(again.replica)  # two in flight there now, none on the other: past the bound
    spilled = balancer.choose(system + "question three", ready)
    assert spilled.replica != first.replica and spilled.reason == "least_loaded"
    other = balancer.choose("a different prompt altogether, long enough", ready)
    assert other.reason == "least_loaded"
    only = balancer.choose(system + "question four", {first.replica})  # the other set aside
    assert only.replica == first.replica


def test_least_loaded_and_round_robin_spread_requests() -> None:
    balancer = Balancer(["r0", "r1", "r2"], RoutingSettings(balance="least_loaded"))
    balancer.started("r0")
    balancer.started("r1")
    assert balancer.choose("p", {"r0", "r1", "r2"}).replica == "r2"
    robin = Balancer(["r0", "r1"], RoutingSettings(balance="round_robin"))
    assert [robin.choose("same prompt", {"r0", "r1"}).replica for _ in range(4)] == ["r0", "r1", "r0", "r1"]
    with pytest.raises(ValueError):
        robin.choose("p", set())


def test_the_prefix_memory_is_bounded() -> None:
    balancer = Balancer(["r0", "r1"], RoutingSettings(affinity_block_bytes=16, affinity_entries=16))
    for index in range(100):
        balancer.choose(f"prompt {index} " * 10, {"r0", "r1"})
    assert len(balancer._served) <= 16
