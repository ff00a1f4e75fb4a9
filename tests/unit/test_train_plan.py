"""The training memory model and `plan --train`: per-rank figures checked against arithmetic done
here by hand from the config numbers (tests/data/model_configs), the smallest layouts for dense and
MoE bases, gradient checkpointing only when needed, and the refusals of bad input."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from appliance import cli
from appliance.errors import Invalid
from appliance.records import Gpu, HardwareProfile, Host
from installer.hardware import parse_hardware_spec
from installer.memory import count_params
from installer.model_config import ModelConfigError, ModelShape, load_model_config
from installer.train_memory import TrainSpec, activation_bytes, adapter_params, attention_linears, rank_memory
from installer.train_plan import TrainFit, TrainPlanError, check_job, cpu_rank_budget, fit, plan_training
from tests.support.appliances import APPLIANCE
from tests.support.models import MODEL_CONFIGS

GIB = 1 << 30
NF4_STATE = 1 / 64 + 4 / (64 * 256)  # 8-bit absmax per 64 weights, an fp32 per 256 absmaxes


def model(name: str) -> ModelShape:
    return load_model_config(MODEL_CONFIGS / f"{name}.json")


def spec(method: str = "lora", rank: int = 16, seq_len: int = 4096, batch: int = 1, **more: object) -> TrainSpec:
    return TrainSpec(method=method, rank=rank, seq_len=seq_len, batch=batch, **more)  # type: ignore[arg-type]


# Llama-3.1-8B by hand: h 4096, I 14336, 32 layers, 32 heads and 8 KV heads of 128, vocab 128256.
L8_ATTENTION = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096  # q, k, v, o: 41,943,040
L8_MLP = 3 * 4096 * 14336  # gate, up, down: 176,160,768
L8_LINEAR = 32 * (L8_ATTENTION + L8_MLP)
L8_TOTAL = 2 * 128256 * 4096 + 32 * (L8_ATTENTION + L8_MLP + 2 * 4096) + 4096  # untied head, norms


def test_llama_8b_base_adapter_and_optimizer_by_hand() -> None:
    llama = model("llama-3.1-8b")
    assert count_params(llama).total == L8_TOTAL == 8_030_261_248  # Meta's published 8.03B
    lora = rank_memory(llama, spec(), ranks=1, device="cuda", checkpointing=False)
    assert lora.base_shard == L8_TOTAL * 2 and lora.quant_state == 0 and lora.buffers == 0
    # r x (in + out) for q (4096 -> 4096), k and v (4096 -> 1024), o; gate and up (4096 -> 14336), down.
    per_layer = 16 * ((4096 + 4096) + 2 * (4096 + 1024) + (4096 + 4096) + 2 * (4096 + 14336) + (14336 + 4096))
    assert adapter_params(llama, spec()).total == 32 * per_layer == 41_943_040
    assert lora.adapter == 32 * per_layer * 4  # fp32
    assert lora.optimizer == 32 * per_layer * 12  # fp32 gradient + two AdamW moments
    four = rank_memory(llama, spec(), ranks=4, device="cuda", checkpointing=False)
    assert four.base_shard == L8_TOTAL * 2 // 4 and four.optimizer == 32 * per_layer * 12 // 4
    qlora = rank_memory(llama, spec("qlora"), ranks=2, device="cuda", checkpointing=False)
    plain = L8_TOTAL - L8_LINEAR  # embeddings, head and norms stay bf16
    assert qlora.base_shard == int((L8_LINEAR * 0.5 + plain * 2) / 2)
    assert qlora.quant_state == int(L8_LINEAR * NF4_STATE)  # whole on every rank


def test_llama_8b_activations_by_hand() -> None:
    """Per token and layer (bf16): two norm inputs, the normed input, q, k, v, the attention output,
    the MLP's normed input, gate, silu, up and product; 32 heads' fp32 log-sum-exp; LoRA's A output
    (16 values) and dropout output + mask (3 bytes an input value) on 7 projections."""
    llama = model("llama-3.1-8b")
    elements = 2 * 4096 + 4096 + (4096 + 1024 + 1024 + 4096) + 4096 + 4 * 14336
    lora = 7 * 16 * 2 + (6 * 4096 + 14336) * 3
    per_token = elements * 2 + 32 * 4 + lora
    tokens = 4096 * 2
    layer = tokens * per_token
    loss = tokens * 128256 * (2 + 8) + tokens * 4096 * 2
    full, checkpointed = activation_bytes(llama, spec(batch=2), "cuda")
    assert full == 32 * layer + loss
    assert checkpointed == 32 * tokens * 4096 * 2 + layer + loss  # layer inputs, one layer recomputed
    # On a CPU the trainer computes in fp32: 4 bytes a value, 5 for a dropout output and its mask.
    cpu_full, _ = activation_bytes(llama, spec(batch=2), "cpu")
    cpu_lora = 7 * 16 * 4 + (6 * 4096 + 14336) * 5
    assert cpu_full == 32 * tokens * (elements * 4 + 32 * 4 + cpu_lora) + tokens * 128256 * 12 + tokens * 4096 * 4


def test_deepseek_mla_projections_match_the_serving_model() -> None:
    """attention_linears (in, out) against installer.memory's counts, and by hand for DeepSeek-V3."""
    for name in ("deepseek-v3", "kimi-k2", "llama-3.1-405b", "qwen3-235b-a22b", "mixtral-8x22b"):
        shape = model(name)
        params = count_params(shape)
        extras = params.layer_attention - sum(i * o for i, o in attention_linears(shape).values())
        assert 0 <= extras < shape.hidden * 4, name  # only norms and biases are left
    deepseek = attention_linears(model("deepseek-v3"))
    assert deepseek == {"q_a": (7168, 1536), "q_b": (1536, 128 * 192), "kv_a": (7168, 576),
                        "kv_b": (512, 128 * 256), "o": (128 * 128, 7168)}


def test_kimi_k2_fsdp_buffers_are_two_whole_moe_layers_and_the_root() -> None:
    """384 experts x (gate, up, down) of 7168 x 2048 in bf16, twice (the running layer and the next,
    prefetched), and the embeddings and head (163840 x 7168 each) the root keeps unsharded."""
    kimi = model("kimi-k2")
    memory = rank_memory(kimi, spec(), ranks=16, device="cuda", checkpointing=True)
    experts = 2 * (384 + 1) * 3 * 7168 * 2048 * 2
    root = 2 * 163840 * 7168 * 2
    assert experts + root < memory.buffers < (experts + root) * 1.01  # the rest: attention, norms, adapters
    qlora = rank_memory(kimi, spec("qlora"), ranks=16, device="cuda", checkpointing=True)
    # NF4 experts in the all-gather, the root still bf16, one linear dequantized at a time.
    assert experts / 4 + root < qlora.buffers < (experts / 4 + root) * 1.03


@pytest.mark.parametrize("name,method,hardware,ranks,hosts,feasible", [
    ("llama-3.1-8b", "lora", "1x8xH100-80", 1, 1, True),
    ("llama-3.1-8b", "qlora", "1x8xH100-80", 1, 1, True),
    ("llama-3.1-70b", "lora", "1x8xH100-80", 3, 1, True),
    ("llama-3.1-70b", "qlora", "1x8xH100-80", 1, 1, True),
    ("llama-3.1-405b", "lora", "2x8xH200-141", 16, 2, True),
    ("llama-3.1-405b", "qlora", "2x8xH200-141", 3, 1, True),
    ("deepseek-v3", "lora", "2x8xH200-141", 24, 3, False),
    ("deepseek-v3", "qlora", "2x8xH200-141", 4, 1, True),
    ("kimi-k2", "lora", "2x8xH200-141", 40, 5, False),
    ("kimi-k2", "qlora", "2x8xH200-141", 6, 1, True),
    ("kimi-k2", "qlora", "1x8xH100-80", 24, 3, False),
])
def test_smallest_layouts(name: str, method: str, hardware: str, ranks: int, hosts: int, feasible: bool) -> None:
    record = plan_training(model(name), parse_hardware_spec(hardware), spec(method))
    assert record.layout is not None and record.per_rank is not None
    assert (record.layout["ranks"], record.layout["hosts"], record.feasible) == (ranks, hosts, feasible)
    assert record.per_rank["total"] <= record.per_rank["budget"]
    # Every smaller layout was tried and refused with its figures; the total really is over.
    assert [r["ranks"] for r in record.rejected] == sorted(r["ranks"] for r in record.rejected)
    assert all(r["ranks"] < ranks and r["total"] > record.per_rank["budget"] for r in record.rejected)
    assert all("GiB" in r["reason"] and "budget" in r["reason"] for r in record.rejected)
    if not feasible:
        assert f"needs {hosts} hosts" in " ".join(record.notes)


def test_qlora_never_needs_more_ranks_than_lora() -> None:
    for name in ("llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b", "deepseek-v3", "kimi-k2"):
        hw = parse_hardware_spec("1x8xH200-141")
        lora, qlora = (plan_training(model(name), hw, spec(method)).layout for method in ("lora", "qlora"))
        assert lora is not None and qlora is not None and qlora["ranks"] <= lora["ranks"], name


def test_a_refusal_names_the_figure_that_does_not_fit() -> None:
    one = plan_training(model("llama-3.1-405b"), parse_hardware_spec("1x8xH100-80"), spec())
    # 405,853,388,800 parameters x 2 bytes = 756.0 GiB on one GPU; 95 % of 80 GiB = 76.0 GiB.
    assert count_params(model("llama-3.1-405b")).total == 405_853_388_800
    assert one.rejected[0]["reason"].startswith("base shard 756.0 GiB alone exceeds the 76.0 GiB per-rank budget")
    never = plan_training(model("kimi-k2"), parse_hardware_spec("1x8xH100-80"), spec())
    assert never.layout is None and not never.feasible
    assert "the largest figure is collective buffers" in never.rejected[-1]["reason"]
    assert any(note.startswith("no number of ranks fits") for note in never.notes)


def test_checkpointing_only_when_needed() -> None:
    llama, h100 = model("llama-3.1-8b"), parse_hardware_spec("1x8xH100-80")
    short = plan_training(llama, h100, spec(seq_len=512, batch=1))
    assert short.checkpointing is False and short.per_rank is not None
    assert short.per_rank["activations"] == short.per_rank["activations_without_checkpointing"]
    assert short.checkpointing_why is not None and short.checkpointing_why.startswith("off")
    long = plan_training(llama, h100, spec(seq_len=8192, batch=2))
    assert long.checkpointing is True and long.per_rank is not None
    assert long.per_rank["activations"] == long.per_rank["activations_with_checkpointing"]
    assert long.checkpointing_why is not None and long.checkpointing_why.startswith("on")


def test_routed_expert_adapters_are_opt_in_and_counted() -> None:
    deepseek = model("deepseek-v3")
    default = adapter_params(deepseek, spec())
    routed = adapter_params(deepseek, spec(targets=("attention", "mlp", "shared_experts", "routed_experts")))
    # 256 experts x r x ((7168 + 2048) x 2 + (2048 + 7168)) on each of the 58 MoE layers.
    assert routed.total - default.total == 58 * 256 * 16 * 3 * (7168 + 2048)
    attention_only = adapter_params(deepseek, spec(targets=("attention",)))
    assert attention_only.dense_layer == attention_only.moe_layer


def cpu_hosts(count: int, ram_gib: int) -> HardwareProfile:
    return HardwareProfile(hosts=[Host(name=f"cpu-{i}", ram_bytes=ram_gib * GIB, cpu_cores=2) for i in range(count)])


def test_cpu_ranks_share_the_host_ram_and_compute_in_fp32() -> None:
    demo = model("smollm2-135m")
    record = plan_training(demo, cpu_hosts(1, 24), spec(seq_len=512, batch=4), ranks_per_host=2)
    assert record.hardware["device"] == "cpu" and record.hardware["budget_per_rank"] == 12 * GIB
    assert record.layout == {"ranks": 2, "hosts": 1, "ranks_per_host": 2} and record.per_rank is not None
    assert record.per_rank["base_shard"] == count_params(demo).total * 4 // 2  # fp32, as the trainer loads it
    assert cpu_rank_budget(24 * GIB, 2) == 12 * GIB
    with pytest.raises(TrainPlanError, match="no ram_bytes"):
        plan_training(demo, HardwareProfile(hosts=[Host(name="bare")]), spec())
    with pytest.raises(TrainPlanError, match="--processes 0: must be at least 1"):
        plan_training(demo, cpu_hosts(1, 24), spec(), ranks_per_host=0)
    with pytest.raises(TrainPlanError, match="--processes is for CPU hosts"):
        plan_training(demo, parse_hardware_spec("1x8xH100-80"), spec(), ranks_per_host=2)


def test_a_cpu_s_malloc_keeps_a_step_s_buffers_only_under_the_mmap_threshold() -> None:
    """A token row of the hidden size under CPU_MMAP_THRESHOLD: a step's freed buffers stay in
    malloc's arenas (0.7 x the activations); larger ones are mapped and go back; a GPU: none."""
    demo = model("smollm2-135m")  # hidden 576: a row of 55 x 2 tokens in fp32 is 253,440 bytes
    short = rank_memory(demo, spec(rank=8, seq_len=55, batch=2), 2, "cpu", checkpointing=False)
    assert short.allocator == int(0.7 * short.activations)
    assert short.total == (short.base_shard + short.adapter + short.optimizer + short.activations + short.buffers
                           + short.runtime + short.allocator)
    assert "allocator's kept buffers" in short.figures()
    assert rank_memory(demo, spec(rank=8, seq_len=512, batch=2), 1, "cpu", checkpointing=False).allocator == 0
    assert rank_memory(demo, spec(rank=8, seq_len=55, batch=2), 2, "cuda", checkpointing=False).allocator == 0


def test_a_trainer_checks_a_job_before_loading_anything(tmp_path: Path) -> None:
    config = MODEL_CONFIGS / "smollm2-135m.json"

    def demo_job(where: Path, ranks: int, memory: int) -> TrainFit:
        return check_job(where, method="lora", rank=8, seq_len=512, batch=4, ranks=ranks, rank_memory_bytes=memory,
                         device="cpu")

    fits = demo_job(config, 2, cpu_rank_budget(24 * GIB, 2))
    assert fits.fits and fits.memory.total < 12 * GIB
    short = demo_job(config, 2, GIB // 2)
    assert not short.fits and short.reason is not None and "GiB" in short.reason and "budget" in short.reason
    with pytest.raises(ModelConfigError, match="no such file"):
        demo_job(tmp_path / "missing", 1, GIB)
    with pytest.raises(TrainPlanError, match="per-rank memory 0"):
        demo_job(config, 1, 0)
    big = check_job(MODEL_CONFIGS / "llama-3.1-405b.json", method="qlora", rank=16, seq_len=4096, batch=1,
                    ranks=2, rank_memory_bytes=80 * GIB, device="cuda")
    assert not big.fits and big.reason is not None and big.reason.startswith("base shard")


@given(name=st.sampled_from(["llama-3.1-8b", "llama-3.1-70b", "deepseek-v3", "kimi-k2", "smollm2-135m"]),
       method=st.sampled_from(["lora", "qlora"]), ranks=st.integers(2, 512), seq_len=st.integers(1, 1 << 17),
       batch=st.integers(1, 64), device=st.sampled_from(["cuda", "cpu"]))
def test_more_ranks_never_need_more_memory_and_checkpointing_never_costs_memory(
        name: str, method: str, ranks: int, seq_len: int, batch: int, device: str) -> None:
    shape, job = model(name), spec(method, seq_len=seq_len, batch=batch)
    fewer, more = (rank_memory(shape, job, n, device, checkpointing=True)  # type: ignore[arg-type]
                   for n in (ranks, ranks * 2))
    assert more.total <= fewer.total and more.buffers == fewer.buffers and more.activations == fewer.activations
    assert fewer.activations_checkpointed <= fewer.activations_full


def test_a_trainer_holding_fp32_on_a_gpu_says_so() -> None:
    """The dtype defaults to the device's (bf16 on a GPU); a trainer that keeps fp32 there asks for it."""
    config = MODEL_CONFIGS / "llama-3.1-8b.json"
    job = {"method": "lora", "rank": 16, "seq_len": 4096, "batch": 1, "ranks": 2, "rank_memory_bytes": 80 * GIB,
           "device": "cuda"}
    bf16, fp32 = check_job(config, **job), check_job(config, **job, dtype="fp32")  # type: ignore[arg-type]
    assert fp32.memory.base_shard == 2 * bf16.memory.base_shard == L8_TOTAL * 2
    assert fp32.memory.activations_full > bf16.memory.activations_full
    with pytest.raises(Invalid, match="dtype 'fp8': not one of bf16, fp32"):
        spec(dtype="fp8")


@given(field=st.sampled_from(["rank", "seq_len", "batch"]), value=st.integers(max_value=0))
def test_counts_below_one_are_refused_naming_the_field(field: str, value: int) -> None:
    good = {"method": "lora", "rank": 8, "seq_len": 512, "batch": 1}
    with pytest.raises(Invalid, match=f"^{field} {value}: must be an integer"):
        TrainSpec(**{**good, field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("changes,message", [
    ({"rank": True}, "rank True"),
    ({"seq_len": 1 << 30}, "seq_len 1073741824: must be an integer from 1 to"),
    ({"method": "full"}, "method 'full': not one of lora, qlora"),
    ({"targets": ("attention", "embeddings")}, "targets embeddings: give one or more of"),
    ({"targets": ()}, r"targets \(none\)"),
    ({"dropout": 1.0}, "dropout 1.0"),
])
def test_bad_specs_are_refused(changes: dict[str, object], message: str) -> None:
    with pytest.raises(Invalid, match=message):
        TrainSpec(**{"method": "lora", "rank": 8, "seq_len": 512, "batch": 1, **changes})  # type: ignore[arg-type]


def test_impossible_layouts_are_refused() -> None:
    with pytest.raises(TrainPlanError, match="at least one rank a host"):
        fit(model("llama-3.1-8b"), spec(), ranks=1, hosts=2, budget=GIB, device="cuda")
    mixed = HardwareProfile(hosts=[Host(name="a", gpus=[Gpu(index=0, name="H100", memory_bytes=80 * GIB)]),
                                   Host(name="b", gpus=[])])
    with pytest.raises(TrainPlanError, match="different GPU counts"):
        plan_training(model("llama-3.1-8b"), mixed, spec())


def invoke(*args: str) -> tuple[int, str, BaseException | None]:
    result = CliRunner().invoke(cli.app, ["plan", *args])
    return result.exit_code, result.stdout, result.exception


def test_cli_plan_train_json_text_and_exit_codes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("APPLIANCE_HOME", str(tmp_path))
    kimi = str(MODEL_CONFIGS / "kimi-k2.json")
    code, out, _ = invoke(kimi, "--hardware", "2x8xH200-141GB", "--train", "qlora", "--rank", "16",
                          "--seq-len", "4096", "--batch", "1", "--json")
    assert code == 0, out
    record = json.loads(out)
    assert record["feasible"] and record["layout"] == {"ranks": 6, "hosts": 1, "ranks_per_host": 6}
    assert record["checkpointing"] is True and len(record["rejected"]) == 5
    for key in ("base_shard", "quant_state", "adapter", "optimizer", "activations_without_checkpointing",
                "activations_with_checkpointing", "buffers", "runtime", "total", "budget"):
        assert key in record["per_rank"]
    code, out, _ = invoke(kimi, "--hardware", "2x8xH200-141GB", "--train", "lora", "--rank", "16",
                          "--seq-len", "4096", "--batch", "1")
    assert code == 3 and "fits only on more hosts: 40 GPUs on 5 hosts" in out
    assert "1 GPU on 1 host" in out and "alone exceeds" in out
    for args, message in ((("--rank", "0"), "--rank 0: must be"), (("--seq-len", "-1"), "--seq-len -1: must be"),
                          (("--batch", "0"), "--batch 0: must be"), (("--tp", "2"), "--tp: serving options"),
                          (("--targets", "experts"), "--targets experts: give one or more")):
        code, _, raised = invoke(kimi, "--hardware", "1x8xH100-80GB", "--train", "lora", *args)
        assert isinstance(raised, Invalid) and message in raised.message, (args, raised)
    _, _, raised = invoke(kimi, "--hardware", "1x8xH100-80GB", "--train", "full")
    assert isinstance(raised, Invalid) and "--train 'full': not one of lora, qlora" in raised.message


def test_cli_plan_train_unknown_model_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APPLIANCE_HOME", str(tmp_path))
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "hidden_size": 8}))
    _, _, raised = invoke(str(config), "--hardware", "1x8xH100-80GB", "--train", "lora")
    assert isinstance(raised, ModelConfigError) and "architectures: 'GPT2LMHeadModel'" in raised.message


@pytest.mark.integration
def test_cli_plan_train_errors_reach_the_operator_as_one_line(tmp_path: Path) -> None:
    done = subprocess.run([APPLIANCE, "plan", str(MODEL_CONFIGS / "llama-3.1-8b.json"), "--hardware",
                           "1x8xH100-80GB", "--train", "lora", "--rank", "0"], capture_output=True, text=True,
                          env={"APPLIANCE_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 1 and "error: --rank 0: must be an integer from 1 to 16384" in done.stderr
