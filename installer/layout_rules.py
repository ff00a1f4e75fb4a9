"""The rules a TP x PP x DP x EP layout must meet before its memory is worth working out: vLLM
0.32's own (each cited at its check, paths under site-packages/vllm) and the appliance launch's.
Each rule says, in words and numbers, why it rules a layout out, or None when it does not.

vLLM accepts more than these rules let through in two places, both the appliance's choice: a TP
group stays inside an NVLink domain unless pinned, and a DP replica stays inside one host (the
launch gives each host `--data-parallel-size-local` whole replicas; vLLM's `--nnodes` could span
them). vLLM refuses nothing for DP > 1 with PP > 1, with or without EP (its process groups are
DP x PP x TP, distributed/parallel_state.py, initialize_model_parallel), so neither does this.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from installer.memory import NO_SPECULATION, Layout, Speculative, shared_experts_replicated
from installer.model_config import ModelShape


@dataclass(frozen=True)
class Site:
    """What the rules need of the hardware and the launch."""

    gpus_per_host: int
    nvlink_reach: int  # GPUs in the smallest host's largest NVLink domain
    speculative: Speculative = NO_SPECULATION


Rule = Callable[[ModelShape, Layout, Site], str | None]


def heads_split(model: ModelShape, tp: int) -> str | None:
    """config/model.py, ModelConfig.verify_with_parallel_config: "Total number of attention heads
    must be divisible by tensor parallel size"; layers/linear.py, QKVParallelLinear.__init__: the KV
    heads are split (kv_heads % tp) or replicated (tp % kv_heads), else an assertion. MLA keeps one
    latent per layer, so only its attention heads count."""
    if model.heads % tp:
        return f"TP {tp} does not divide the {model.heads} attention heads"
    if model.mla is None and model.kv_heads % tp and tp % model.kv_heads:
        return f"TP {tp} neither divides nor is a multiple of the {model.kv_heads} KV heads"
    return None


def tp_splits_heads(model: ModelShape, layout: Layout, site: Site) -> str | None:
    return heads_split(model, layout.tp)


def tp_inside_nvlink(model: ModelShape, layout: Layout, site: Site) -> str | None:
    """The appliance's: a TP group's all-reduce runs every layer, so it stays on NVLink."""
    if layout.tp <= site.gpus_per_host and layout.tp > site.nvlink_reach:
        return f"a TP group of {layout.tp} GPUs exceeds the {site.nvlink_reach}-GPU NVLink domain"
    return None


def replica_inside_host(model: ModelShape, layout: Layout, site: Site) -> str | None:
    """The appliance's launch: `--data-parallel-size-local` places whole replicas on each host."""
    replica = layout.tp * layout.pp
    if layout.dp > 1 and replica > site.gpus_per_host:
        return (f"a replica of TP{layout.tp} x PP{layout.pp} = {replica} GPUs would span hosts: the launch places "
                "whole data-parallel replicas on each host")
    return None


def tp_across_hosts_alone(model: ModelShape, layout: Layout, site: Site) -> str | None:
    """The appliance's: TP over whole hosts (pinned only) is not combined with PP."""
    if layout.pp > 1 and layout.tp > site.gpus_per_host:
        return "TP across hosts together with PP is not offered"
    return None


def expert_ranks(model: ModelShape, layout: Layout, site: Site) -> str | None:
    """fused_moe/config.py, FusedMoEParallelConfig.make: EP spans TP x DP ranks and is silently off
    over one rank; expert_map_manager.py, determine_expert_map: E // ep experts a rank, the first
    E % ep ranks one more, so ranks beyond E would hold none."""
    if not layout.ep or model.experts is None:
        return None
    ranks = layout.tp * layout.dp
    if ranks == 1:
        return "EP over TP x DP = 1 rank has no other rank to spread the experts to"
    if ranks > model.experts.routed:
        return f"EP over TP x DP = {ranks} ranks leaves ranks without any of the {model.experts.routed} experts"
    return None


def experts_split_by_tp(model: ModelShape, layout: Layout, site: Site) -> str | None:
    """fused_moe/config.py (intermediate_size_per_partition): without EP every rank of TP x DP holds
    a slice of every expert, asserting `intermediate_size % tp_size == 0`; with FP8 blocks the slice
    must also be whole blocks (quantization/utils/fp8_utils.py, validate_fp8_block_shape_moe: "The
    output_size of gate's and up's weight = X is not divisible by weight quantization block_n")."""
    if layout.ep or model.experts is None:
        return None
    ranks, size = layout.tp * layout.dp, model.experts.intermediate
    if size % ranks:
        return f"without EP, TP x DP = {ranks} does not divide the experts' intermediate size {size}"
    block = _block(model)
    if block and (size // ranks) % block:
        return (f"without EP, each of TP x DP = {ranks} ranks gets {size // ranks} of the experts' {size} columns, "
                f"not a multiple of the {block}-wide FP8 blocks")
    return None


def fp8_blocks_per_rank(model: ModelShape, layout: Layout, site: Site) -> str | None:
    """quantization/utils/fp8_utils.py, validate_fp8_block_shape: each TP-split linear's share must
    be whole blocks ("Weight input_size_per_partition = X is not divisible by weight quantization
    block_k"). Checked on the row-parallel inputs (attention output, dense and shared-expert down
    projections) and the MLA's query and KV up-projections."""
    block = _block(model)
    if not block or layout.tp == 1:
        return None
    for name, size in _tp_split_sizes(model, layout).items():
        if size % layout.tp or (size // layout.tp) % block:
            return (f"TP {layout.tp} splits {name} ({size}) into {size / layout.tp:g}-wide shares, not whole "
                    f"{block}-wide FP8 blocks")
    return None


def draft_fits_tp(model: ModelShape, layout: Layout, site: Site) -> str | None:
    """config/speculative.py and v1/spec_decode/draft_model.py: a draft model runs at the target's
    TP ("'draft_tensor_parallel_size' and 'tensor_parallel_size' must be the same"), so its heads
    must split at that TP too."""
    draft = site.speculative.draft
    if draft is None or (problem := heads_split(draft, layout.tp)) is None:
        return None
    return f"the draft model {draft.name}: {problem}"


RULES: tuple[Rule, ...] = (tp_splits_heads, tp_inside_nvlink, replica_inside_host, tp_across_hosts_alone,
                           expert_ranks, experts_split_by_tp, fp8_blocks_per_rank, draft_fits_tp)


def rule_out(model: ModelShape, layout: Layout, site: Site) -> str | None:
    """The first rule that rules the layout out, in words; None when none does."""
    for rule in RULES:
        if (reason := rule(model, layout, site)) is not None:
            return reason
    return None


def _block(model: ModelShape) -> int | None:
    """The FP8 block width of a block-quantized checkpoint (quantization_config.weight_block_size)."""
    sizes = (model.quantization or {}).get("weight_block_size")
    if isinstance(sizes, list) and sizes and all(isinstance(s, int) and s > 0 for s in sizes):
        return math.lcm(*sizes)
    return None


def _tp_split_sizes(model: ModelShape, layout: Layout) -> dict[str, int]:
    """The dimension TP splits of each quantized linear whose share must be whole blocks."""
    sizes: dict[str, int] = {}
    if model.mla is not None:
        m = model.mla
        sizes["the query up-projection"] = model.heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        sizes["the KV up-projection"] = model.heads * (m.qk_nope_head_dim + m.v_head_dim)
        sizes["the attention output"] = model.heads * m.v_head_dim
    else:
        sizes["the attention output"] = model.heads * model.head_dim
    if model.intermediate:
        sizes["the dense MLP's down projection"] = model.intermediate
    if model.experts is not None and model.experts.shared and not shared_experts_replicated(layout):
        sizes["the shared experts' down projection"] = model.experts.shared * model.experts.intermediate
    return sizes
