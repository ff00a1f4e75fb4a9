"""How the gateway serves a request once admitted: the routing policy over tiers and replicas, and
its response cache."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from appliance.settings.section import Section


class RoutingSettings(Section):
    """Which pool and which engine of it serve a request: tiers by the routing policy, replicas by
    load and prompt-prefix affinity."""

    IN_SUPERVISOR_CONFIG = False

    interactive_tier: str | None = Field(
        "fast", description="A streamed request for a model's bare name goes to this tier, where the model has it "
        "(unset: to default_tier)."
    )
    default_tier: str = Field(
        "full", description="Other requests for a bare name (not streamed, long prompts, batches) go to this tier, "
        "where the model has it; a model without it answers from its first pool in the settings."
    )
    long_prompt_chars: int = Field(
        8000, gt=0, description="A streamed request whose prompt is longer than this is long-context: it goes to "
        "default_tier."
    )
    balance: Literal["affinity", "least_loaded", "round_robin"] = Field(
        "affinity", description="How a pool's replicas share requests: affinity (the replica that served the "
        "longest prefix of the prompt recently, unless it is busier than the least loaded by more than "
        "affinity_max_skew), least_loaded (fewest in flight) or round_robin."
    )
    affinity_block_bytes: int = Field(
        256, ge=16, le=65536, description="Prompt prefixes are remembered in blocks of this many bytes (UTF-8).")
    affinity_max_blocks: int = Field(64, ge=1, le=4096, description="Blocks remembered of one prompt at most.")
    affinity_max_skew: int = Field(
        4, ge=0, description="Requests in flight the affinity replica may have above the least loaded one.")
    affinity_entries: int = Field(65536, ge=16, description="Prefix blocks remembered at most (oldest forgotten).")


class CacheSettings(Section):
    """The gateway's exact-match response cache for deterministic requests (temperature 0 or a seed)."""

    IN_SUPERVISOR_CONFIG = False

    enabled: bool = Field(True, description="Answer repeated deterministic requests from the cache.")
    scope: Literal["user", "role"] = Field(
        "user", description="Who shares entries: each user their own (user), or users holding the same roles (role).")
    ttl_s: float = Field(300.0, gt=0, description="How long an entry is served.")
    max_entries: int = Field(4096, ge=1, description="Entries at most (least recently used dropped).")
    max_bytes: int = Field(64 << 20, ge=1024, description="Bytes of answers held at most.")
    max_entry_bytes: int = Field(1 << 20, ge=1024, description="Larger answers are not kept.")
