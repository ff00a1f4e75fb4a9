"""What the planner and the launcher read from outside (a model's config.json, a plan file, a hardware
profile or shorthand) is bounded and checked: a FIFO, a device, an oversized or deeply nested file,
or a field out of range is refused with an error that names the file and the field, never a hang,
an exhausted memory or a raw Python exception."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from appliance.errors import ApplianceError
from appliance.records import PLAN_MAX_BYTES, Gpu, HardwareProfile, Host, Plan, load_plan
from installer.hardware import ProfileError, load_profile, parse_hardware_spec
from installer.model_config import CONFIG_MAX_BYTES, ModelConfigError, load_model_config, parse_config
from installer.planner import plan
from tests.support.models import MODEL_CONFIGS

GIB = 1 << 30


def raised(call: Callable[[], object]) -> BaseException:
    """What `call` raises, run in a thread so that a call that blocks fails the test, not hangs it."""
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # handed to the test to judge
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=20)
    assert not thread.is_alive(), "the call blocked"
    assert outcome, "the call raised nothing"
    return outcome[0]


def config(name: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((MODEL_CONFIGS / f"{name}.json").read_text())
    return result


def plan_record() -> dict[str, Any]:
    """A feasible plan for Llama 3.1 70B on two hosts of 8 H100, as its JSON file holds it."""
    record = plan(load_model_config(MODEL_CONFIGS / "llama-3.1-70b.json"), parse_hardware_spec("2x8xH100-80GB"),
                  context=8192, concurrency=1)
    result: dict[str, Any] = record.model_dump(mode="json")
    return result


# --- unbounded reads ------------------------------------------------------------------------


def special_file(kind: str, path: Path) -> Path:
    """A FIFO nobody writes to, or a link to /dev/zero (endless), at `path`."""
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    return path


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_config_json_that_is_not_a_regular_file_is_refused(tmp_path: Path, kind: str) -> None:
    checkpoint = tmp_path / "model"
    checkpoint.mkdir()
    file = special_file(kind, checkpoint / "config.json")
    error = raised(lambda: load_model_config(checkpoint))
    assert isinstance(error, ModelConfigError)
    assert error.message == f"{file}: cannot read the config: not a regular file"


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_plan_file_that_is_not_a_regular_file_is_refused(tmp_path: Path, kind: str) -> None:
    file = special_file(kind, tmp_path / "plan.json")
    error = raised(lambda: load_plan(file, "pools.main.plan"))
    assert isinstance(error, ApplianceError)
    assert error.message == "pools.main.plan: cannot read the plan: not a regular file"


def test_oversized_config_and_plan_files_are_refused_before_they_are_read(tmp_path: Path) -> None:
    """Sparse files: their size is what is refused, without reading (or writing) the bytes."""
    config_file, plan_file = tmp_path / "config.json", tmp_path / "plan.json"
    with config_file.open("wb") as handle:
        handle.truncate(CONFIG_MAX_BYTES + 1)
    with plan_file.open("wb") as handle:
        handle.truncate(PLAN_MAX_BYTES + 1)
    with pytest.raises(ModelConfigError, match=rf"config.json: cannot read the config: {CONFIG_MAX_BYTES + 1} "
                                               rf"bytes, over the limit of {CONFIG_MAX_BYTES}"):
        load_model_config(config_file)
    with pytest.raises(ApplianceError, match=rf"pools.main.plan: cannot read the plan: {PLAN_MAX_BYTES + 1} "
                                             rf"bytes, over the limit of {PLAN_MAX_BYTES}"):
        load_plan(plan_file, "pools.main.plan")


def test_a_config_json_linked_to_a_regular_file_loads(tmp_path: Path) -> None:
    """Hugging Face caches link config.json to a blob: links to regular files are followed."""
    checkpoint = tmp_path / "model"
    checkpoint.mkdir()
    (checkpoint / "config.json").symlink_to(MODEL_CONFIGS / "llama-3.1-70b.json")
    assert load_model_config(checkpoint).layers == 80


def test_a_hardware_profile_that_is_a_fifo_is_refused(tmp_path: Path) -> None:
    file = special_file("fifo", tmp_path / "cluster.json")
    error = raised(lambda: load_profile(file))
    assert isinstance(error, ProfileError)
    assert error.message == f"{file}: cannot read the profile: not a regular file"


def test_a_plan_file_that_is_not_json_says_so(tmp_path: Path) -> None:
    file = tmp_path / "plan.json"
    file.write_text("no plan here")
    with pytest.raises(ApplianceError, match=r"^pools.main.plan: not a plan record: Invalid JSON: expected ident at "
                                             "line 1 column 2"):
        load_plan(file, "pools.main.plan")


def test_deeply_nested_json_is_not_a_config(tmp_path: Path) -> None:
    file = tmp_path / "config.json"
    file.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ModelConfigError, match="config.json: not a readable JSON config: nested too deeply"):
        load_model_config(file)


def test_a_model_path_too_long_for_the_filesystem_is_named(tmp_path: Path) -> None:
    path = tmp_path / ("m" * 300)
    with pytest.raises(ModelConfigError, match=r"m{300}: cannot read the model: File name too long"):
        load_model_config(path)


# --- the --hardware shorthand ---------------------------------------------------------------


@pytest.mark.parametrize(("spec", "problem"), [
    ("99999999999999999999x8xH100-80GB", "not of the form"),
    ("1x8xH100-" + "9" * 5000 + "GB", "not of the form"),
    ("65x8xH100-80GB", "HOSTS in HOSTSxGPUSxNAME-MEMORY is 65; it must be from 1 to 64"),
    ("1x30000xH100-80GB", "GPUS in HOSTSxGPUSxNAME-MEMORY is 30000; it must be from 1 to 72"),
    ("1x73xH100-80GB", "GPUS in HOSTSxGPUSxNAME-MEMORY is 73; it must be from 1 to 72"),
    ("1x8xH100-4097GB", "MEMORY in HOSTSxGPUSxNAME-MEMORY is 4097; it must be from 1 to 4096"),
    ("1x8x" + "H" * 200 + "-80GB", "not of the form"),
])
def test_hardware_shorthands_beyond_the_limits_are_refused(spec: str, problem: str) -> None:
    error = raised(lambda: parse_hardware_spec(spec))
    assert isinstance(error, ProfileError)
    line = error.one_line()
    assert line.startswith("--hardware ") and problem in line
    assert "at most 64 hosts, 72 GPUs a host, 4096 GiB a GPU" in line


def test_the_largest_hardware_shorthand_is_made() -> None:
    profile = parse_hardware_spec("64x72xGB200-4096GB")
    assert len(profile.hosts) == 64 and {len(host.gpus) for host in profile.hosts} == {72}


def test_profiles_from_files_are_bounded_too(tmp_path: Path) -> None:
    gpu = {"index": 0, "name": "H100", "memory_bytes": 80 * GIB}
    many_hosts = tmp_path / "hosts.json"
    many_hosts.write_text(json.dumps({"hosts": [{"name": f"n{i}"} for i in range(1025)]}))
    with pytest.raises(ProfileError, match=r"hosts.json: hosts: List should have at most 1024 items"):
        load_profile(many_hosts)
    many_gpus = tmp_path / "gpus.json"
    many_gpus.write_text(json.dumps({"hosts": [{"name": "n0", "gpus": [{**gpu, "index": i} for i in range(257)]}]}))
    with pytest.raises(ProfileError, match=r"gpus.json: hosts.n0.gpus: List should have at most 256 items"):
        load_profile(many_gpus)
    assert len(HardwareProfile(hosts=[Host(name="n0", gpus=[Gpu(**{**gpu, "index": i}) for i in range(256)])])
               .hosts[0].gpus) == 256


# --- config.json fields ---------------------------------------------------------------------


@pytest.mark.parametrize(("model", "field", "value", "problem"), [
    ("llama-3.1-70b", "torch_dtype", ["bfloat16"], "['bfloat16'] is not one of bfloat16, float16, float32"),
    ("llama-3.1-70b", "torch_dtype", {"a": 1}, "{'a': 1} is not one of"),
    ("qwen3-235b-a22b", "mlp_only_layers", 5, "5 is not a list of distinct layer indexes from 0 to 93"),
    ("qwen3-235b-a22b", "mlp_only_layers", "abc", "'abc' is not a list of distinct layer indexes"),
    ("qwen3-235b-a22b", "mlp_only_layers", [0, 0], "[0, 0] is not a list of distinct layer indexes"),
    ("qwen3-235b-a22b", "mlp_only_layers", [94], "[94] is not a list of distinct layer indexes"),
    ("qwen3-235b-a22b", "mlp_only_layers", [-1], "[-1] is not a list of distinct layer indexes"),
    ("qwen3-235b-a22b", "mlp_only_layers", [True], "[True] is not a list of distinct layer indexes"),
    ("qwen3-235b-a22b", "mlp_only_layers", list(range(10**5)), "characters) is not a list of distinct layer indexes"),
    ("deepseek-v3", "first_k_dense_replace", 62, "62 is more than num_hidden_layers (61)"),
    ("llama-3.1-70b", "head_dim", 10**300, "0000... (301 characters) is more than 1099511627776"),
    ("llama-3.1-70b", "vocab_size", 2**40 + 1, "1099511627777 is more than 1099511627776"),
])
def test_config_fields_out_of_range_are_named(model: str, field: str, value: object, problem: str) -> None:
    with pytest.raises(ModelConfigError) as caught:
        parse_config({**config(model), field: value}, name=model, source="cfg.json")
    assert caught.value.message.startswith(f"cfg.json: {field}: ") and problem in caught.value.message


def test_a_moe_config_whose_layers_are_all_dense_is_still_read() -> None:
    """The bounds are the layer count itself: every layer dense leaves no MoE layer, never fewer."""
    qwen = parse_config({**config("qwen3-235b-a22b"), "mlp_only_layers": list(range(94))}, name="q", source="q")
    deepseek = parse_config({**config("deepseek-v3"), "first_k_dense_replace": 61}, name="d", source="d")
    assert qwen.experts is not None and qwen.experts.moe_layers == 0
    assert deepseek.experts is not None and deepseek.experts.moe_layers == 0


@pytest.mark.parametrize("sizes", [[0], [-128], ["a"], "128", {}, [], [128, 128, 128], [True], [128.0],
                                   [128] * 10**6])
def test_an_fp8_block_size_that_is_not_one_or_two_positive_integers_is_refused(sizes: object) -> None:
    shape = config("deepseek-v3")
    shape["quantization_config"] = {**shape["quantization_config"], "weight_block_size": sizes}
    with pytest.raises(ModelConfigError, match=r"^cfg.json: quantization_config.weight_block_size: .* is not a list "
                                               "of 1 or 2 positive integers"):
        parse_config(shape, name="deepseek-v3", source="cfg.json")


@pytest.mark.parametrize("sizes", [[128, 128], [64], None])
def test_fp8_block_sizes_as_checkpoints_give_them_are_kept(sizes: object) -> None:
    shape = config("deepseek-v3")
    shape["quantization_config"] = {**shape["quantization_config"], "weight_block_size": sizes}
    parsed = parse_config(shape, name="deepseek-v3", source="cfg.json")
    assert parsed.quantization is not None and parsed.quantization["weight_block_size"] == sizes


# --- plan records ---------------------------------------------------------------------------


def changed(record: dict[str, Any], where: str, value: object) -> dict[str, Any]:
    """A copy of `record` with the field at the dotted `where` set to `value`."""
    copy = json.loads(json.dumps(record))
    *parents, last = where.split(".")
    node = copy
    for part in parents:
        node = node[part]
    node[last] = value
    return copy


@pytest.mark.parametrize(("where", "value", "problem"), [
    ("target.context", 0, "target.context: Input should be greater than or equal to 1"),
    ("target.context", 2**31 + 1, "target.context: Input should be less than or equal to 2147483648"),
    ("target.concurrency", 0, "target.concurrency: Input should be greater than or equal to 1"),
    ("objective", "fastest", "objective: Input should be 'capacity' or 'min-gpus'"),
    ("model.quantization", "awq", "model.quantization: Input should be 'fp8' or 'bitsandbytes'"),
    ("layout.gpus", 12, r"layout: gpus 12 is not tp x pp x dp \(8 x 2 x 1\)"),
    ("layout.hosts", 3, "layout: hosts 3 does not divide gpus 16"),
    ("layout.hosts", 32, "layout: hosts 32 does not divide gpus 16"),
    ("commands", [{"host": "n", "role": "head", "argv": [], "env": {}}] * 1025,
     "commands: List should have at most 1024 items"),
])
def test_plan_files_out_of_range_are_refused_naming_the_field(tmp_path: Path, where: str, value: object,
                                                              problem: str) -> None:
    record = plan_record()
    assert record["layout"] == {"tp": 8, "pp": 2, "dp": 1, "ep": False, "gpus": 16, "hosts": 2}
    file = tmp_path / "plan.json"
    file.write_text(json.dumps(changed(record, where, value)))
    with pytest.raises(ApplianceError, match=rf"^pools.main.plan: not a plan record: {problem}"):
        load_plan(file, "pools.main.plan")


def test_a_plan_lists_at_most_100_000_rejected_layouts() -> None:
    record = plan_record()
    record["rejected"] = [{"layout": record["layout"], "reason": "r"}] * 100_001
    with pytest.raises(ValidationError, match="rejected\n  List should have at most 100000 items"):
        Plan.model_validate(record)


@pytest.mark.parametrize(("model", "dtype", "fmt", "quantization"), [
    ("llama-3.1-70b", "bfloat16", None, None),
    ("llama-3.1-70b", "bfloat16", "fp8", "fp8"),
    ("llama-3.1-70b", "bfloat16", "nf4", "bitsandbytes"),
    ("llama-3.1-70b", "float32", "bf16", None),  # a --dtype, which the launch sets
    ("llama-3.1-70b", "float32", "fp16", None),
    ("deepseek-v3", "bfloat16", None, None),
])
def test_plans_the_planner_writes_load(tmp_path: Path, model: str, dtype: str, fmt: str | None,
                                       quantization: str | None) -> None:
    """Every quantization the planner writes is one a plan file may hold; a plan from before the
    objective was recorded loads as min-gpus."""
    shape = parse_config({**config(model), "torch_dtype": dtype}, name=model, source=f"{model}.json")
    record = plan(shape, parse_hardware_spec("2x8xH200-141GB"), context=8192, concurrency=1, fmt=fmt)
    assert record.model.quantization == quantization
    file = tmp_path / "plan.json"
    file.write_text(record.model_dump_json())
    assert load_plan(file, "pools.main.plan") == record
    older = record.model_dump(mode="json", exclude={"objective"})
    file.write_text(json.dumps(older))
    assert load_plan(file, "pools.main.plan").objective == "min-gpus"
