"""Each rule a layout must meet (vLLM 0.32's and the launch's), one test a rule, against the
published configs in tests/data/model_configs; and the memory model's reading of vLLM's expert
placement and speculative decoding."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from appliance.records import SpeculativeConfig
from installer.layout_rules import (
    Site,
    draft_fits_tp,
    expert_ranks,
    experts_split_by_tp,
    fp8_blocks_per_rank,
    replica_inside_host,
    rule_out,
    tp_across_hosts_alone,
    tp_inside_nvlink,
    tp_splits_heads,
)
from installer.memory import Layout, Speculative, count_params, kv_bytes_per_token, weight_bytes_per_gpu
from installer.model_config import ModelShape, load_model_config
from installer.planner import Pins, PlanError, speculation
from installer.planner import plan as make_plan
from tests.unit.test_planner import hosts, model

HOST = Site(gpus_per_host=8, nvlink_reach=8)


def test_tp_must_split_the_attention_heads_and_the_kv_heads_one_way_or_the_other() -> None:
    mixtral = model("mixtral-8x22b")  # 48 heads, 8 KV heads
    assert tp_splits_heads(mixtral, Layout(tp=32), HOST) == "TP 32 does not divide the 48 attention heads"
    assert tp_splits_heads(mixtral, Layout(tp=16), HOST) is None  # 16 KV ranks: each KV head twice
    odd = dataclasses.replace(mixtral, kv_heads=6)
    assert tp_splits_heads(odd, Layout(tp=4), HOST) == "TP 4 neither divides nor is a multiple of the 6 KV heads"
    # MLA keeps one latent per layer: only the attention heads count.
    assert tp_splits_heads(model("deepseek-v3"), Layout(tp=16), HOST) is None


def test_a_tp_group_stays_inside_an_nvlink_domain() -> None:
    assert tp_inside_nvlink(model("mixtral-8x22b"), Layout(tp=8), Site(8, 4)) == \
        "a TP group of 8 GPUs exceeds the 4-GPU NVLink domain"
    assert tp_inside_nvlink(model("mixtral-8x22b"), Layout(tp=4), Site(8, 4)) is None


def test_a_data_parallel_replica_stays_inside_one_host() -> None:
    reason = replica_inside_host(model("mixtral-8x22b"), Layout(tp=4, pp=2, dp=2), Site(4, 4))
    assert reason is not None and "TP4 x PP2 = 8 GPUs would span hosts" in reason
    assert replica_inside_host(model("mixtral-8x22b"), Layout(tp=4, pp=2), Site(4, 4)) is None  # PP may


def test_tp_across_hosts_is_not_combined_with_pp() -> None:
    assert tp_across_hosts_alone(model("mixtral-8x22b"), Layout(tp=8, pp=2), Site(4, 4)) == \
        "TP across hosts together with PP is not offered"


def test_expert_parallelism_needs_ranks_to_spread_to_and_experts_for_each() -> None:
    mixtral = model("mixtral-8x22b")  # 8 experts
    assert "no other rank" in (expert_ranks(mixtral, Layout(pp=4, ep=True), HOST) or "")
    assert expert_ranks(mixtral, Layout(tp=4, dp=4, ep=True), HOST) == \
        "EP over TP x DP = 16 ranks leaves ranks without any of the 8 experts"
    # An uneven split is vLLM's to make (the first ranks take one more): not a rule.
    assert expert_ranks(model("kimi-k2"), Layout(tp=8, dp=32, ep=True), HOST) is None


def test_without_ep_every_rank_takes_whole_fp8_blocks_of_every_expert() -> None:
    deepseek = model("deepseek-v3")  # moe_intermediate_size 2048, FP8 blocks of 128
    assert experts_split_by_tp(deepseek, Layout(tp=8, dp=2), HOST) is None  # 128 columns each
    reason = experts_split_by_tp(deepseek, Layout(tp=8, dp=4), HOST)
    assert reason == ("without EP, each of TP x DP = 32 ranks gets 64 of the experts' 2048 columns, not a "
                      "multiple of the 128-wide FP8 blocks")
    assert experts_split_by_tp(deepseek, Layout(tp=8, dp=4, ep=True), HOST) is None  # whole experts
    experts = model("mixtral-8x22b").experts
    assert experts is not None
    uneven = dataclasses.replace(model("mixtral-8x22b"), experts=dataclasses.replace(experts, intermediate=100))
    assert experts_split_by_tp(uneven, Layout(tp=8), HOST) == \
        "without EP, TP x DP = 8 does not divide the experts' intermediate size 100"


def test_tp_splits_each_fp8_linear_into_whole_blocks() -> None:
    deepseek = model("deepseek-v3")
    assert fp8_blocks_per_rank(deepseek, Layout(tp=16), HOST) is None
    assert fp8_blocks_per_rank(deepseek, Layout(tp=32), HOST) == \
        "TP 32 splits the dense MLP's down projection (18432) into 576-wide shares, not whole 128-wide FP8 blocks"
    assert fp8_blocks_per_rank(model("llama-3.1-405b"), Layout(tp=32), HOST) is None  # bf16: no blocks


def test_a_draft_model_runs_at_the_targets_tp(tmp_path: Path) -> None:
    draft = small_llama(tmp_path, heads=4, kv_heads=2)
    site = Site(8, 8, Speculative(draft=draft))
    assert draft_fits_tp(model("llama-3.1-405b"), Layout(tp=8), site) == \
        "the draft model draft: TP 8 does not divide the 4 attention heads"
    assert draft_fits_tp(model("llama-3.1-405b"), Layout(tp=4), site) is None


def test_the_planner_offers_no_layout_a_rule_rules_out() -> None:
    deepseek = model("deepseek-v3")
    record = make_plan(deepseek, hosts(4, gib=141, name="H200"), context=32768, concurrency=16)
    for offered in [record.layout, *(a.layout for a in record.alternatives)]:
        assert offered is not None
        layout = Layout(tp=offered.tp, pp=offered.pp, dp=offered.dp, ep=offered.ep)
        assert rule_out(deepseek, layout, HOST) is None, layout
    reasons = {(r.layout.tp, r.layout.pp, r.layout.dp, r.layout.ep): r.reason for r in record.rejected}
    assert reasons[(8, 1, 4, False)].startswith("without EP, each of TP x DP = 32 ranks gets 64")


def test_routed_experts_spread_over_tp_x_dp_with_or_without_ep() -> None:
    """fused_moe: without EP the TP x DP ranks each hold a slice of every expert, as much as EP's
    whole experts when they split evenly; unevenly, the fullest rank holds one more."""
    mixtral = model("mixtral-8x22b")
    assert weight_bytes_per_gpu(mixtral, Layout(tp=2, dp=4), "bf16") == \
        weight_bytes_per_gpu(mixtral, Layout(tp=2, dp=4, ep=True), "bf16")
    kimi = model("kimi-k2")  # 384 experts: 256 ranks hold 2 or 1, 192 ranks hold 2 each
    assert weight_bytes_per_gpu(kimi, Layout(dp=256, ep=True), "fp8") == \
        weight_bytes_per_gpu(kimi, Layout(dp=192, ep=True), "fp8")


def test_shared_experts_are_whole_on_every_rank_with_ep_tp_and_dp() -> None:
    deepseek = model("deepseek-v3")
    experts = deepseek.experts
    assert experts is not None
    unshared = dataclasses.replace(deepseek, experts=dataclasses.replace(experts, shared=0))
    shared = count_params(deepseek).layer_shared * experts.moe_layers  # fp8: a byte each, and the scales

    def shared_bytes(layout: Layout) -> float:
        return weight_bytes_per_gpu(deepseek, layout, "fp8") - weight_bytes_per_gpu(unshared, layout, "fp8")

    assert shared_bytes(Layout(tp=2, dp=2, ep=True)) == pytest.approx(shared * (1 + 4 / 128 ** 2), rel=1e-6)
    assert shared_bytes(Layout(tp=2, dp=1, ep=True)) == pytest.approx(shared / 2 * (1 + 4 / 128 ** 2), rel=1e-6)


def test_mtp_adds_its_module_weights_and_one_layer_of_kv() -> None:
    """DeepSeek-V3's MTP module is 14B parameters in the checkpoint (685B less the 671B main model);
    served, it shares the target's lm_head, and its embedding too when PP is 1."""
    deepseek = model("deepseek-v3")
    mtp = speculation(deepseek, "mtp")
    in_checkpoint = mtp.weight_bytes(deepseek, Layout(pp=2), "bf16") / 2 + deepseek.vocab * deepseek.hidden
    assert abs(in_checkpoint / 14e9 - 1) < 0.05, in_checkpoint
    assert mtp.weight_bytes(deepseek, Layout(pp=2), "bf16") - mtp.weight_bytes(deepseek, Layout(), "bf16") == \
        deepseek.vocab * deepseek.hidden * 2
    assert mtp.kv_bytes_per_token(deepseek, Layout(tp=8)) == 576 * 2  # one more MLA layer
    plain = make_plan(deepseek, hosts(1, gib=141, name="H200"), context=8192, concurrency=1, pins=_pins(8))
    with_mtp = make_plan(deepseek, hosts(1, gib=141, name="H200"), context=8192, concurrency=1, pins=_pins(8),
                         speculative=mtp)
    assert plain.per_gpu is not None and with_mtp.per_gpu is not None
    assert with_mtp.per_gpu.weights - plain.per_gpu.weights == mtp.weight_bytes(deepseek, Layout(tp=8), "fp8")
    assert with_mtp.kv_bytes_per_token == (plain.kv_bytes_per_token or 0) + 1152
    assert with_mtp.target.speculative == SpeculativeConfig(method="mtp", num_speculative_tokens=1)
    argv = with_mtp.commands[0].argv
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {"method": "mtp", "num_speculative_tokens": 1}
    assert any(note.startswith("speculative decoding (mtp, 1 token(s) a step)") for note in with_mtp.notes)


def test_speculation_asked_of_a_model_without_it_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="kimi-k2 has no multi-token-prediction layers"):
        speculation(model("kimi-k2"), "mtp")
    with pytest.raises(PlanError, match="--speculative-tokens 0: must be between 1 and 64"):
        speculation(model("deepseek-v3"), "mtp", tokens=0)
    with pytest.raises(Exception, match="no such file"):
        speculation(model("deepseek-v3"), str(tmp_path / "absent"))


def test_a_draft_model_adds_its_weights_and_kv_at_the_targets_tp(tmp_path: Path) -> None:
    target = model("llama-3.1-405b")
    draft = small_llama(tmp_path, heads=32, kv_heads=8)
    ask = speculation(target, str(tmp_path / "draft.json"), tokens=3)
    assert ask.vllm_config() == SpeculativeConfig(method="draft_model", model=str(tmp_path.resolve()),
                                                  num_speculative_tokens=3)
    assert ask.weight_bytes(target, Layout(tp=8, pp=2), "bf16") == weight_bytes_per_gpu(draft, Layout(tp=8), "bf16")
    assert ask.kv_bytes_per_token(target, Layout(tp=8)) == kv_bytes_per_token(draft, Layout(tp=8))


def small_llama(directory: Path, *, heads: int, kv_heads: int) -> ModelShape:
    """A Llama-3.2-1B-shaped draft model's config (16 layers, hidden 2048), as `draft.json`."""
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "intermediate_size": 8192,
              "num_hidden_layers": 16, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": 64, "vocab_size": 128256, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
    (directory / "draft.json").write_text(json.dumps(config))
    return load_model_config(directory / "draft.json")


def _pins(tp: int) -> Pins:
    return Pins(tp=tp, pp=1, dp=1, ep=False)


@pytest.mark.parametrize("speculative,problem", [
    ({"method": "eagle", "num_speculative_tokens": 1}, "method"),
    ({"method": "mtp", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "mtp", "num_speculative_tokens": [1]}, "num_speculative_tokens"),
    ({"method": "mtp", "num_speculative_tokens": 1, "model": "/m"}, "only with it"),
    ({"method": "draft_model", "num_speculative_tokens": 1}, "only with it"),
    ({"method": "draft_model", "num_speculative_tokens": 1, "model": "/m\n--trust-remote-code"}, "model"),
    ({"method": "mtp", "num_speculative_tokens": 1, "extra": "--x"}, "extra"),
])
def test_a_plan_files_speculative_config_is_checked_before_any_launch(tmp_path: Path, speculative: dict[str, object],
                                                                     problem: str) -> None:
    """What a plan file says goes into the launch's argv: only a well-formed config is accepted."""
    from appliance.errors import ApplianceError
    from appliance.records import load_plan

    record = make_plan(model("deepseek-v3"), hosts(1, gib=141, name="H200"), context=8192, concurrency=1,
                       speculative=speculation(model("deepseek-v3"), "mtp")).model_dump(mode="json")
    record["target"]["speculative"] = speculative
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(record))
    with pytest.raises(ApplianceError, match=problem):
        load_plan(path, "pools.main.plan")


@pytest.mark.parametrize("given,tokens,problem", [
    ("mtp", 65, "--speculative-tokens 65: must be between 1 and 64"),
    (None, 3, "--speculative-tokens 3: give --speculative too"),
    ("", 1, "give 'mtp' or a draft model's directory"),
    ("/models/draft\n--trust-remote-code", 1, "give 'mtp' or a draft model's directory"),
    ("/models/dr\u2028aft", 1, "give 'mtp' or a draft model's directory"),
    ("/models/\udcffdraft", 1, "give 'mtp' or a draft model's directory"),
])
def test_what_speculative_decoding_is_asked_of_is_checked(given: str | None, tokens: int, problem: str) -> None:
    with pytest.raises(PlanError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        speculation(model("deepseek-v3"), given, tokens)


def test_a_draft_is_named_by_its_absolute_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine runs elsewhere than where `plan` ran, and vLLM loads a draft from a directory."""
    small_llama(tmp_path, heads=32, kv_heads=8)
    monkeypatch.chdir(tmp_path)
    ask = speculation(model("llama-3.1-405b"), "draft.json")
    assert ask.draft_ref == str(tmp_path.resolve())


def test_pins_that_leave_nothing_to_consider_say_so() -> None:
    with pytest.raises(PlanError, match=r"no layout meets the pins \(--dp 1000000000\) on 1 to 64 hosts of 8 GPUs"):
        make_plan(model("mixtral-8x22b"), hosts(1), context=8192, concurrency=1, pins=Pins(dp=10**9))
    with pytest.raises(PlanError, match="context 0 and concurrency 1: each must be at least 1"):
        make_plan(model("mixtral-8x22b"), hosts(1), context=0, concurrency=1)
    huge = make_plan(model("mixtral-8x22b"), hosts(1), context=8192, concurrency=10**400)
    assert not huge.feasible  # integer arithmetic: no overflow
