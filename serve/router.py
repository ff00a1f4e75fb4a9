"""Where a request goes: the tier of its model (by name, or by the routing policy) and the replica
of that pool (by load and prompt-prefix affinity).

Prefix affinity, as vLLM production-stack's prefix-aware router and llm-d's scheduler do it: a
replica that recently served a prompt holds its prefix in its KV cache (vLLM's automatic prefix
caching), so a prompt sharing that prefix is cheaper there. The prompt is cut into blocks, each
block's hash chained to the ones before it; the balancer remembers which replica served each chain
and sends a prompt to the replica holding its longest remembered prefix, unless that replica has
more than `affinity_max_skew` requests in flight above the least loaded one (one hot prefix cannot
overload one replica). Otherwise, and for prompts never seen, the least loaded replica serves.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

from appliance.settings import RoutingSettings
from serve.errors import ModelNotFound

Reason = Literal["affinity", "least_loaded", "round_robin"]
T = TypeVar("T")


def split_model(model: str, served: Collection[str]) -> tuple[str, str | None]:
    """(served model name, tier asked for or None) from a request's `model`: a served name as it
    is, else `NAME:TIER`."""
    if model in served or ":" not in model:
        return model, None
    name, tier = model.rsplit(":", 1)
    return name, tier


def pick_tier(model: str, tiers: Mapping[str | None, T], tier: str | None, *, stream: bool, prompt_chars: int,
              policy: RoutingSettings) -> T:
    """The tier serving a request for `model` and its pool: the one asked for by name, else by the
    policy (streamed and not long: the interactive tier; otherwise the default tier; a model
    without the tier the policy names: its first pool)."""
    if tier is not None:
        if tier not in tiers:
            named = [f"{model}:{name}" for name in tiers if name is not None]
            raise ModelNotFound(f"model {model!r} has no tier {tier!r}", [model, *named])
        return tiers[tier]
    interactive = stream and prompt_chars <= policy.long_prompt_chars
    for wanted in ((policy.interactive_tier,) if interactive else ()) + (policy.default_tier,):
        if wanted in tiers:
            return tiers[wanted]
    return next(iter(tiers.values()))


def prefix_chain(prompt: str, block_bytes: int, max_blocks: int) -> list[bytes]:
    """Chained hashes of the prompt's blocks: the i-th stands for the prompt's first i+1 blocks
    (the last block may be short)."""
    chain: list[bytes] = []
    previous = b""
    data = prompt.encode("utf-8", "surrogatepass")
    for start in range(0, min(len(data), block_bytes * max_blocks), block_bytes):
        previous = hashlib.blake2b(previous + data[start:start + block_bytes], digest_size=12).digest()
        chain.append(previous)
    return chain


@dataclass(frozen=True)
class Choice:
    replica: str
    reason: Reason


class Balancer:
    """One pool's replicas: their requests in flight, and the prompt prefixes each served recently."""

    def __init__(self, replicas: Sequence[str], policy: RoutingSettings) -> None:
        self.replicas = list(replicas)
        self.policy = policy
        self.in_flight = dict.fromkeys(self.replicas, 0)
        self._served: OrderedDict[bytes, str] = OrderedDict()  # prefix chain hash -> replica, oldest first
        self._turn = itertools.count()

    def choose(self, prompt: str, ready: Collection[str]) -> Choice:
        """The replica (of those `ready`) to serve `prompt`, remembered as holding its prefix."""
        candidates = [replica for replica in self.replicas if replica in ready]
        if not candidates:
            raise ValueError("no ready replica to choose from")
        if self.policy.balance == "round_robin":
            return Choice(candidates[next(self._turn) % len(candidates)], "round_robin")
        chain = prefix_chain(prompt, self.policy.affinity_block_bytes, self.policy.affinity_max_blocks)
        least = min(self.in_flight[replica] for replica in candidates)
        choice = None
        if self.policy.balance == "affinity":
            for matched in range(len(chain), 0, -1):
                holder = self._served.get(chain[matched - 1])
                if holder in candidates and self.in_flight[holder] <= least + self.policy.affinity_max_skew:
                    choice = Choice(holder, "affinity")
                    break
        if choice is None:  # the least loaded; on ties, in turn
            idle = [replica for replica in candidates if self.in_flight[replica] == least]
            choice = Choice(idle[next(self._turn) % len(idle)], "least_loaded")
        for block in chain:
            self._served[block] = choice.replica
            self._served.move_to_end(block)
        while len(self._served) > self.policy.affinity_entries:
            self._served.popitem(last=False)
        return choice

    def started(self, replica: str) -> None:
        self.in_flight[replica] += 1

    def finished(self, replica: str) -> None:
        self.in_flight[replica] -= 1
