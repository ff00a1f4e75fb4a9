"""The memory model and the planner against published figures and the formulas in
../shared/notes/reference.md, from config files only (tests/data/model_configs, the fields of the
published config.json files that the planner reads; no weights)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from appliance.engine_launch import python
from appliance.records import Gpu, HardwareProfile, Host
from installer.layout_rules import Site, rule_out
from installer.memory import FormatError, Layout, count_params, kv_bytes_per_token
from installer.model_config import ModelConfigError, load_model_config
from installer.planner import Pins, PlanError
from installer.planner import plan as make_plan
from tests.support.appliances import APPLIANCE
from tests.support.models import MODEL_CONFIGS

GIB = 1 << 30


def model(name: str):
    return load_model_config(MODEL_CONFIGS / f"{name}.json")


def plan(*args: object, **kwargs: object) -> dict:
    return make_plan(*args, **kwargs).model_dump()


def hosts(count: int, gpus: int = 8, gib: int = 80, name: str = "H100") -> HardwareProfile:
    return HardwareProfile(hosts=[
        Host(name=f"node-{i}", nvlink_all_to_all=True,
             gpus=[Gpu(index=j, name=name, memory_bytes=gib * GIB) for j in range(gpus)])
        for i in range(count)])


@pytest.mark.parametrize("name,published,active", [
    ("deepseek-v3", 671e9, 37e9),
    ("kimi-k2", 1.026e12, 32e9),
    ("qwen3-235b-a22b", 235e9, 22e9),
    ("llama-3.1-405b", 405e9, 405e9),
    ("mixtral-8x22b", 141e9, 39e9),
])
def test_parameter_counts_match_published_totals(name: str, published: float, active: float) -> None:
    params = count_params(model(name))
    assert abs(params.total / published - 1) < 0.005, f"{name}: {params.total / 1e9:.2f}B"
    assert abs(params.active / active - 1) < 0.03, f"{name}: {params.active / 1e9:.2f}B active"


@pytest.mark.parametrize("name,layout,expected", [
    ("llama-3.1-405b", Layout(), 516_096),  # 2 x 126 x 8 x 128 x 2
    ("llama-3.1-405b", Layout(tp=8), 64_512),
    ("qwen3-235b-a22b", Layout(), 192_512),
    ("qwen3-235b-a22b", Layout(tp=8), 48_128),  # 4 KV heads over 8 ranks: one each, duplicated
    ("deepseek-v3", Layout(), 70_272),  # MLA: 61 x (512 + 64) x 2, no factor 2
    ("deepseek-v3", Layout(tp=8), 70_272),  # the latent is not split by TP
    ("deepseek-v3", Layout(tp=8, pp=2), 31 * 576 * 2),  # PP splits layers (the fullest stage)
])
def test_kv_bytes_per_token_follow_the_formulas(name: str, layout: Layout, expected: int) -> None:
    assert kv_bytes_per_token(model(name), layout) == expected


def test_llama_405b_bf16_needs_two_hosts_of_8x80() -> None:
    one = plan(model("llama-3.1-405b"), hosts(1), context=8192, concurrency=1)
    assert not one["feasible"]
    [tp8] = [r for r in one["rejected"] if r["layout"]["tp"] == 8 and r["layout"]["pp"] == 1]
    assert "GiB per GPU exceed the 72.0 GiB budget" in tp8["reason"]
    assert one["smallest_fitting_hardware"]["hosts"] == 2
    two = plan(model("llama-3.1-405b"), hosts(2), context=8192, concurrency=1)
    assert two["feasible"] and two["layout"]["gpus"] == 16 and two["layout"]["hosts"] == 2


def test_deepseek_v3_fp8_fits_one_8x141_host_not_one_8x80() -> None:
    big = plan(model("deepseek-v3"), hosts(1, gib=141, name="H200"), context=8192, concurrency=1)
    assert big["feasible"] and big["model"]["format"] == "fp8" and big["layout"]["hosts"] == 1
    assert big["per_gpu"]["weights"] + big["per_gpu"]["reserve"] <= big["per_gpu"]["budget"]
    small = plan(model("deepseek-v3"), hosts(1), context=8192, concurrency=1)
    assert not small["feasible"]
    here = [r for r in small["rejected"] if r["layout"]["hosts"] == 1]
    weights = [r for r in here if "exceed" in r["reason"]]
    layouts = {id(r): Layout(**{k: r["layout"][k] for k in ("tp", "pp", "dp", "ep")}) for r in here}
    assert weights and all(rule_out(model("deepseek-v3"), layouts[id(r)], Site(8, 8)) == r["reason"]
                           for r in here if r not in weights)
    assert all(r["reason"].startswith("needs 16 GPUs on 2 hosts") for r in small["rejected"] if r not in here)


def test_kimi_k2_fp8_needs_two_hosts_of_8x80() -> None:
    one = plan(model("kimi-k2"), hosts(1), context=8192, concurrency=1)
    assert not one["feasible"] and one["smallest_fitting_hardware"]["hosts"] == 2
    two = plan(model("kimi-k2"), hosts(2), context=8192, concurrency=1, model_ref="/models/kimi-k2")
    assert two["feasible"] and two["layout"]["hosts"] == 2
    head, worker = two["commands"]
    assert head["role"] == "head" and worker["role"] == "worker" and "--headless" in worker["argv"]
    assert head["argv"][:4] == [python(), "-P", "-m", "serve.vllm_rank"]
    assert head["argv"][head["argv"].index("--model") + 1] == "/models/kimi-k2"
    assert "--uds" in head["argv"] and "--uds" not in worker["argv"]
    for command in (head, worker):
        assert command["gpus"] == list(range(8)) and command["env"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
        assert not any("KEY" in name for name in command["env"]), "no secret in a printed launch"


def test_pins_are_honoured_or_refused() -> None:
    pinned = plan(model("llama-3.1-405b"), hosts(2), context=8192, concurrency=1, pins=Pins(tp=4))
    assert pinned["layout"]["tp"] == 4
    with pytest.raises(PlanError, match="--tp 3 is not possible"):
        plan(model("llama-3.1-405b"), hosts(2), context=8192, concurrency=1, pins=Pins(tp=3))
    with pytest.raises(PlanError, match="has no experts"):
        plan(model("llama-3.1-405b"), hosts(2), context=8192, concurrency=1, pins=Pins(ep=True))


def test_concurrency_target_needs_kv_room() -> None:
    record = plan(model("llama-3.1-405b"), hosts(2), context=131072, concurrency=64)
    assert not record["feasible"]
    assert any("need" in r["reason"] and "tokens" in r["reason"] for r in record["rejected"])


def test_formats() -> None:
    assert plan(model("llama-3.1-405b"), hosts(1), context=8192, concurrency=1, fmt="fp8")["feasible"]
    with pytest.raises(FormatError, match="stored as fp8; vLLM cannot serve it as bf16"):
        plan(model("deepseek-v3"), hosts(2), context=8192, concurrency=1, fmt="bf16")
    with pytest.raises(FormatError, match="not one of"):
        plan(model("llama-3.1-405b"), hosts(1), context=8192, concurrency=1, fmt="fp3")


def test_bad_configs_are_named(tmp_path: Path) -> None:
    config = json.loads((MODEL_CONFIGS / "llama-3.1-405b.json").read_text())
    del config["num_hidden_layers"]
    (tmp_path / "missing.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match=r"missing.json: num_hidden_layers: missing"):
        load_model_config(tmp_path / "missing.json")
    (tmp_path / "odd.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelConfigError, match="'GPT2LMHeadModel' is not one the planner models"):
        load_model_config(tmp_path / "odd.json")
    (tmp_path / "zero.json").write_text(json.dumps({**config, "num_hidden_layers": 0}))
    with pytest.raises(ModelConfigError, match="num_hidden_layers: 0 is not an integer >= 1"):
        load_model_config(tmp_path / "zero.json")
    with pytest.raises(ModelConfigError, match="no such file"):
        load_model_config(tmp_path / "absent")


def test_impossible_profiles_are_refused() -> None:
    with pytest.raises(PlanError, match="no GPUs"):
        plan(model("mixtral-8x22b"), HardwareProfile(hosts=[Host(name="cpu-only")]), context=8192, concurrency=1)
    mixed = HardwareProfile(hosts=[*hosts(1).hosts,
                                   Host(name="small", gpus=[Gpu(index=0, name="L4", memory_bytes=24 * GIB)])])
    with pytest.raises(PlanError, match="different GPU counts"):
        plan(model("mixtral-8x22b"), mixed, context=8192, concurrency=1)


@pytest.mark.integration
def test_cli_plan_json_and_exit_codes() -> None:
    ok = subprocess.run([APPLIANCE, "plan", str(MODEL_CONFIGS / "kimi-k2.json"), "--hardware", "2x8xH100-80GB",
                         "--json"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    record = json.loads(ok.stdout)
    for key in ("feasible", "layout", "per_gpu", "kv_bytes_per_token", "kv_capacity_tokens", "commands", "rejected"):
        assert key in record
    assert record["model"]["total_params"] > 1e12
    none = subprocess.run([APPLIANCE, "plan", str(MODEL_CONFIGS / "kimi-k2.json"), "--hardware", "1x8xH100-80GB"],
                          capture_output=True, text=True)
    assert none.returncode == 3 and "smallest hardware that fits: 2 hosts" in none.stdout
    both = subprocess.run([APPLIANCE, "plan", str(MODEL_CONFIGS / "kimi-k2.json"), "--hardware", "1x8xH100-80GB",
                           "--detect"], capture_output=True, text=True)
    assert both.returncode == 1 and "exactly one of --profile, --detect, --hardware" in both.stderr


def test_tp_over_whole_hosts_only_when_pinned() -> None:
    """A pinned TP may span whole hosts (vLLM's --nnodes); it is never chosen unasked."""
    two = hosts(2, gpus=4)
    assert plan(model("mixtral-8x22b"), two, context=8192, concurrency=1)["layout"]["tp"] <= 4
    pinned = plan(model("mixtral-8x22b"), two, context=8192, concurrency=1, pins=Pins(tp=8))
    assert (pinned["layout"]["tp"], pinned["layout"]["hosts"]) == (8, 2)
    head, worker = pinned["commands"]
    for node, command in enumerate((head, worker)):
        argv = command["argv"]
        assert argv[argv.index("--nnodes") + 1] == "2" and argv[argv.index("--node-rank") + 1] == str(node)
        assert command["gpus"] == [0, 1, 2, 3]
    assert "--headless" in worker["argv"] and any("spans 2 hosts" in note for note in pinned["notes"])
    with pytest.raises(PlanError, match="--tp 6 is not possible"):
        plan(model("mixtral-8x22b"), two, context=8192, concurrency=1, pins=Pins(tp=6))


def test_the_default_objective_fills_the_host_and_min_gpus_leaves_gpus_free() -> None:
    """DeepSeek-V3 FP8 on one 8 x H200 host at 32k x 16: the most KV tokens takes all eight GPUs;
    --objective min-gpus takes six (the rule before), and each says why, against the runner-up."""
    capacity = plan(model("deepseek-v3"), hosts(1, gib=141, name="H200"), context=32768, concurrency=16)
    fewest = plan(model("deepseek-v3"), hosts(1, gib=141, name="H200"), context=32768, concurrency=16,
                  objective="min-gpus")
    assert capacity["objective"] == "capacity" and capacity["layout"]["gpus"] == 8
    assert fewest["objective"] == "min-gpus" and fewest["layout"]["gpus"] == 6
    assert capacity["kv_capacity_tokens"] > 3 * fewest["kv_capacity_tokens"]
    runner_up = capacity["runner_up"]
    assert runner_up == capacity["alternatives"][0]
    assert runner_up["kv_capacity_tokens"] <= capacity["kv_capacity_tokens"]
    lead = capacity["kv_capacity_tokens"] / runner_up["kv_capacity_tokens"]
    assert capacity["choice"].startswith(f"capacity: TP{capacity['layout']['tp']} x ")
    assert f"{capacity['kv_capacity_tokens']:,} KV tokens" in capacity["choice"]
    assert f"{lead:.2f}x the runner-up" in capacity["choice"] or "as many as the runner-up" in capacity["choice"]
    assert fewest["choice"].startswith("min-gpus: ") and "uses 6 GPUs" in fewest["choice"]
    # Every layout that fits is listed, best first by the objective.
    tokens = [capacity["kv_capacity_tokens"]] + [a["kv_capacity_tokens"] for a in capacity["alternatives"]]
    assert tokens == sorted(tokens, reverse=True)


def test_capacity_ties_go_to_fewer_hosts_then_less_traffic_between_hosts() -> None:
    """A model that fits one host of two: the capacity objective serves it on both (twice the KV
    tokens as DP replicas), which crosses hosts only by sharing the load."""
    one, two = (plan(model("mixtral-8x22b"), hosts(n), context=8192, concurrency=1) for n in (1, 2))
    assert one["layout"]["hosts"] == 1 and two["layout"]["hosts"] == 2
    assert two["kv_capacity_tokens"] > one["kv_capacity_tokens"]
    assert plan(model("mixtral-8x22b"), hosts(2), context=8192, concurrency=1,
                objective="min-gpus")["layout"]["hosts"] == 1


def test_every_layout_considered_is_explained_data_and_expert_parallel_included() -> None:
    """Kimi-K2 at 128k on one 8 x H200 host fits nowhere; the rejected list has the data-parallel and
    expert-parallel layouts with their numbers, and DP16 + EP with the host boundary that rules it out."""
    record = plan(model("kimi-k2"), hosts(1, gib=141, name="H200"), context=131072, concurrency=1)
    assert not record["feasible"] and record["smallest_fitting_hardware"]["hosts"] == 2
    reasons = {(r["layout"]["tp"], r["layout"]["pp"], r["layout"]["dp"], r["layout"]["ep"]): r["reason"]
               for r in record["rejected"]}
    assert "exceed the 126.9 GiB budget" in reasons[(1, 1, 8, True)]
    assert reasons[(4, 1, 2, True)].startswith("KV cache ") and "131,072-token sequences need 131,072" in \
        reasons[(4, 1, 2, True)]
    assert reasons[(1, 1, 16, True)].startswith("needs 16 GPUs on 2 hosts (1 host(s) of 8 GPUs here)")
    assert "sequences of 131,072" in reasons[(1, 1, 16, True)]
    assert "no other rank" in reasons[(1, 1, 1, True)]
    # Everything on this host was considered: each TP x PP x DP up to 8 GPUs, with and without EP.
    on_this_host = {k for k, _ in reasons.items() if k[0] * k[1] * k[2] <= 8}
    assert len(on_this_host) == 2 * sum(1 for tp in (1, 2, 4, 8) for pp in range(1, 9) for dp in range(1, 9)
                                        if tp * pp * dp <= 8)


def test_gpus_other_pools_hold_are_left_out() -> None:
    """Capacity takes all the GPUs the pool may use: not those another pool's settings name."""
    deepseek = model("deepseek-v3")
    record = make_plan(deepseek, hosts(1, gib=141, name="H200"), context=32768, concurrency=16,
                       reserved={"fast": [6, 7]})
    assert record.layout is not None and record.layout.gpus <= 6
    assert all(set(command.gpus) <= set(range(6)) for command in record.commands)
    assert "GPUs 6, 7 of each host left out: pool fast holds them (pools.fast.gpus)" in record.notes
    with pytest.raises(PlanError, match=r"every GPU is held by other pools \(a, b"):
        make_plan(deepseek, hosts(1, gpus=2), context=8192, concurrency=1, reserved={"a": [0], "b": [1]})


@pytest.mark.integration
def test_cli_plan_leaves_out_gpus_other_pools_hold_and_checks_its_objective(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "settings.toml").write_text('[engine]\ndevice = "cuda"\n[[pools]]\nname = "main"\n'
                                        '[[pools]]\nname = "fast"\ngpus = [4, 5, 6, 7]\n')
    env = {**os.environ, "APPLIANCE_HOME": str(home)}
    config = str(MODEL_CONFIGS / "mixtral-8x22b.json")
    planned = subprocess.run([APPLIANCE, "plan", config, "--hardware", "1x8xH100-80GB", "--json"],
                             capture_output=True, text=True, env=env)
    assert planned.returncode == 0, planned.stderr
    record = json.loads(planned.stdout)
    assert record["layout"]["gpus"] <= 4 and record["objective"] == "capacity"
    assert record["commands"][0]["gpus"] == [0, 1, 2, 3]
    wrong = subprocess.run([APPLIANCE, "plan", config, "--hardware", "1x8xH100-80GB", "--objective", "most"],
                           capture_output=True, text=True, env=env)
    assert wrong.returncode == 1 and "--objective 'most': not one of capacity, min-gpus" in wrong.stderr


def test_a_float32_checkpoint_served_in_16_bits_is_a_dtype_not_a_quantization(tmp_path: Path) -> None:
    """vLLM 0.32 has no bf16 or fp16 quantization method: serving an fp32 checkpoint in 16 bits is
    its --dtype, which the launch sets."""
    config = json.loads((MODEL_CONFIGS / "llama-3.1-70b.json").read_text()) | {"torch_dtype": "float32"}
    (tmp_path / "fp32.json").write_text(json.dumps(config))
    record = plan(load_model_config(tmp_path / "fp32.json"), hosts(1), context=8192, concurrency=1, fmt="bf16")
    assert record["model"]["format"] == "bf16" and record["model"]["quantization"] is None
    assert "--quantization" not in record["commands"][0]["argv"]
    fp8 = plan(load_model_config(tmp_path / "fp32.json"), hosts(1), context=8192, concurrency=1, fmt="fp8")
    assert fp8["model"]["quantization"] == "fp8"
