"""Staging a checkpoint for a plan (`subset`): per-host tensor sets, byte-exact copies, the
manifest, resume after kill -9, verification, and bad inputs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from appliance.errors import StateError
from appliance.staging_manifest import StagingManifest
from installer.staging import MANIFEST, StagingError, pp_layers, read_header, stage_sharded, stage_subset, verify_staged
from serve.routes.plans import staging_of
from tests.support.appliances import APPLIANCE
from tests.support.checkpoints import llama
from tests.support.plans import plan_for


def deepseek_like(directory: Path, *, layers: int = 4, experts: int = 8) -> Path:
    """A scaled-down DeepSeek-V3/Kimi-K2: MLA names, a dense first layer, routed and shared
    experts, FP8-style scale tensors and one multi-token-prediction layer."""
    directory.mkdir(parents=True, exist_ok=True)
    h, inter = 32, 16
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "hidden_size": h,
              "intermediate_size": 64, "moe_intermediate_size": inter, "num_hidden_layers": layers,
              "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
              "n_routed_experts": experts, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
              "q_lora_rank": 16, "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
              "v_head_dim": 8, "vocab_size": 128, "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16"}
    (directory / "config.json").write_text(json.dumps(config))
    tensors = {"model.embed_tokens.weight": torch.zeros(128, h, dtype=torch.bfloat16),
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
               "lm_head.weight": torch.zeros(128, h, dtype=torch.bfloat16)}
    for i in range(layers + 1):  # the last one is the MTP layer
        p = f"model.layers.{i}"
        for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            tensors[f"{p}.self_attn.{name}.weight"] = torch.full((8, h), i, dtype=torch.bfloat16)
        tensors[f"{p}.self_attn.kv_a_layernorm.weight"] = torch.ones(8, dtype=torch.bfloat16)
        if i == 0:
            for name in ("gate_proj", "up_proj", "down_proj"):
                tensors[f"{p}.mlp.{name}.weight"] = torch.zeros(64, h, dtype=torch.bfloat16)
            continue
        tensors[f"{p}.mlp.gate.weight"] = torch.zeros(experts, h, dtype=torch.bfloat16)
        for e in range(experts):
            for name in ("gate_proj", "up_proj", "down_proj"):
                tensors[f"{p}.mlp.experts.{e}.{name}.weight"] = torch.full((inter, h), e, dtype=torch.bfloat16)
                tensors[f"{p}.mlp.experts.{e}.{name}.weight_scale_inv"] = torch.ones(1, 1)
        tensors[f"{p}.mlp.shared_experts.up_proj.weight"] = torch.zeros(inter, h, dtype=torch.bfloat16)
    save_file(tensors, directory / "model.safetensors")
    return directory


def staged_names(directory: Path) -> set[str]:
    names: set[str] = set()
    for path in directory.glob("*.safetensors"):
        header, _ = read_header(path)
        names |= {n for n in header if n != "__metadata__"}
    return names


def test_pipeline_stages_get_their_layers_byte_exact(tmp_path: Path) -> None:
    source = llama(tmp_path / "src", layers=5)
    record = plan_for(source, "2x1xL4-24GB", tp=1, pp=2)
    assert record.layout.hosts == 2
    stage_subset(source, record, tmp_path / "out")
    first, last = (tmp_path / "out" / name for name in ("node-0", "node-1"))
    assert pp_layers(5, 2) == [range(0, 3), range(3, 5)]  # vLLM gives the remainder to the first
    layer = lambda names: {int(n.split(".")[2]) for n in names if ".layers." in n}  # noqa: E731
    assert layer(staged_names(first)) == {0, 1, 2} and layer(staged_names(last)) == {3, 4}
    assert "model.embed_tokens.weight" in staged_names(first) - staged_names(last)
    assert {"lm_head.weight", "model.norm.weight"} <= staged_names(last) - staged_names(first)
    for host in (first, last):
        index = json.loads((host / "model.safetensors.index.json").read_text())["weight_map"]
        assert set(index) == staged_names(host) and all((host / f).is_file() for f in index.values())
        assert (host / "config.json").is_file() and (host / "tokenizer.json").is_file()
        for file in set(index.values()):
            with safe_open(host / file, "pt") as staged, safe_open(source / file, "pt") as original:
                for name in staged.keys():
                    assert torch.equal(staged.get_tensor(name), original.get_tensor(name)), name
    assert verify_staged(tmp_path / "out") == [str(first), str(last)]


def test_dp_ep_plan_splits_experts_over_hosts(tmp_path: Path) -> None:
    source = deepseek_like(tmp_path / "src", experts=8)
    record = plan_for(source, "2x4xH100-80GB", tp=1, pp=1, dp=8, ep=True)
    assert (record.layout.dp, record.layout.ep, record.layout.hosts) == (8, True, 2)
    stage_subset(source, record, tmp_path / "out")
    for index, host in enumerate(("node-0", "node-1")):
        names = staged_names(tmp_path / "out" / host)
        experts = {int(n.split(".")[5]) for n in names if ".experts." in n}
        assert experts == set(range(index * 4, index * 4 + 4)), host
        assert f"model.layers.3.mlp.experts.{index * 4}.down_proj.weight_scale_inv" in names
        assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate_proj.weight",
                "model.layers.2.mlp.shared_experts.up_proj.weight", "model.layers.4.self_attn.o_proj.weight",
                "model.layers.3.self_attn.kv_a_layernorm.weight"} <= names, "every host holds a whole replica"


def test_flipped_byte_is_named_by_file_and_tensor(tmp_path: Path) -> None:
    source = llama(tmp_path / "src")
    stage_subset(source, plan_for(source, "1x1xL4-24GB"), tmp_path / "out")
    host = tmp_path / "out" / "node-0"
    target = host / "model-00002-of-00003.safetensors"
    header, base = read_header(target)
    name = sorted(n for n in header if n != "__metadata__")[3]
    offset = base + header[name]["data_offsets"][0] + 5
    data = bytearray(target.read_bytes())
    data[offset] ^= 0x01
    target.write_bytes(bytes(data))
    with pytest.raises(StagingError,
                       match=rf"model-00002-of-00003.safetensors: SHA-256 differs .*tensor {name} differs"):
        verify_staged(tmp_path / "out")


@pytest.mark.integration
def test_resume_after_kill_is_byte_identical(tmp_path: Path) -> None:
    source = llama(tmp_path / "src", layers=8, hidden=512, vocab=4096, files=12)  # ~50 MB in 12 files
    record = plan_for(source, "1x1xL4-24GB")
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(record.model_dump_json())
    stage_subset(source, record, tmp_path / "whole")
    command = [APPLIANCE, "stage", str(source), "--plan", str(plan_file), "--out", str(tmp_path / "killed"),
               "--workers", "1"]
    manifest = tmp_path / "killed" / "node-0" / MANIFEST
    killed = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (manifest.exists() and json.loads(manifest.read_text())["files"]) and killed.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    done_before = len(json.loads(manifest.read_text())["files"])
    assert 1 <= done_before < 12, "killed after the first file and before the last"
    resumed = subprocess.run(command, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{done_before} already done" in resumed.stdout, resumed.stdout
    whole = json.loads((tmp_path / "whole" / "node-0" / MANIFEST).read_text())["files"]
    again = json.loads(manifest.read_text())["files"]
    assert {n: e["sha256"] for n, e in again.items()} == {n: e["sha256"] for n, e in whole.items()}
    assert verify_staged(tmp_path / "killed")


def test_bad_inputs_name_the_file_and_tensor(tmp_path: Path) -> None:
    source = llama(tmp_path / "src")
    record = plan_for(source, "1x1xL4-24GB")
    other = llama(tmp_path / "other", layers=6)
    with pytest.raises(StagingError, match="the plan was made for src"):
        stage_subset(other, record, tmp_path / "out")
    shard = source / "model-00003-of-00003.safetensors"
    content = shard.read_bytes()
    shard.write_bytes(content[:-100])
    with pytest.raises(StagingError, match=r"model-00003-of-00003.safetensors: truncated: tensor .* ends at byte"):
        stage_subset(source, record, tmp_path / "out")
    shard.unlink()
    with pytest.raises(StagingError, match=r"model-00003-of-00003.safetensors: missing shard \(the index puts"):
        stage_subset(source, record, tmp_path / "out")
    shard.write_bytes(content)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "hidden_size": 128}))
    with pytest.raises(StagingError, match=r"tensor model.embed_tokens.weight: shape \[256, 64\] disagrees"):
        stage_subset(source, plan_for(source, "1x1xL4-24GB"), tmp_path / "out")


def test_sharded_format_per_tp_rank_with_manifest(tmp_path: Path) -> None:
    source = llama(tmp_path / "src", layers=2)
    record = plan_for(source, "1x2xL4-24GB", tp=2, pp=1)
    [staged] = stage_sharded(source, record, tmp_path / "out")
    names = sorted(p.name for p in staged.directory.glob("model-rank-*.safetensors"))
    assert names == ["model-rank-0-part-0.safetensors", "model-rank-1-part-0.safetensors"]
    assert (staged.directory / "config.json").is_file()
    assert verify_staged(tmp_path / "out")
    # What the admin API and the TUI show counts the parts and their bytes, not the ranks.
    view = staging_of(staged.directory)
    assert (view.format, view.files, view.complete) == ("sharded", 2, True)
    assert view.bytes == sum((staged.directory / n).stat().st_size for n in names) > 0
    again = stage_sharded(source, record, tmp_path / "out")
    assert again[0].resumed == 2, "finished ranks are not redone"
    target = staged.directory / names[1]
    header, base = read_header(target)
    name = "model.layers.1.mlp.down_proj.weight"
    data = bytearray(target.read_bytes())
    data[base + header[name]["data_offsets"][0] + 3] ^= 0x10
    target.write_bytes(bytes(data))
    with pytest.raises(StagingError,
                       match=rf"model-rank-1-part-0.safetensors: SHA-256 differs .*tensor {name} changed"):
        verify_staged(tmp_path / "out")
    with pytest.raises(StagingError, match="needs a plan without pipeline parallelism"):
        stage_sharded(source, plan_for(source, "2x1xL4-24GB", tp=1, pp=2), tmp_path / "pp")


def test_both_manifest_formats_are_one_typed_model_and_a_damaged_one_is_named(tmp_path: Path) -> None:
    source = llama(tmp_path / "src", layers=2)
    [subset] = stage_subset(source, plan_for(source, "1x1xL4-24GB"), tmp_path / "subset")
    [sharded] = stage_sharded(source, plan_for(source, "1x2xL4-24GB", tp=2, pp=1), tmp_path / "sharded")
    for staged, fmt in ((subset, "subset"), (sharded, "sharded")):
        manifest = StagingManifest.load(staged.directory)
        assert manifest.format == fmt and manifest.complete
        assert StagingManifest.model_validate_json(manifest.model_dump_json()) == manifest  # one model reads both
        view = staging_of(staged.directory)
        files = [p for p in staged.directory.glob("*.safetensors")]
        assert (view.files, view.bytes) == (len(files), sum(p.stat().st_size for p in files))
    (subset.directory / MANIFEST).write_text('{"format": "sharded", "files": {}}')
    with pytest.raises(StateError, match=rf"{MANIFEST}: not a readable staging manifest"):
        staging_of(subset.directory)
    with pytest.raises(StagingError, match="not a readable staging manifest"):
        verify_staged(tmp_path / "subset")
    with pytest.raises(StagingError, match="not a readable staging manifest") as kept:  # not thrown away
        stage_subset(source, plan_for(source, "1x1xL4-24GB"), tmp_path / "subset")
    assert "to stage this host afresh" in (kept.value.hint or "")


@pytest.mark.integration
def test_cli_names_a_bad_plan_file(tmp_path: Path) -> None:
    source = llama(tmp_path / "src")
    bad = tmp_path / "plan.json"
    bad.write_text('{"model": {}}')
    result = subprocess.run([APPLIANCE, "stage", str(source), "--plan", str(bad), "--out", str(tmp_path / "out")],
                            capture_output=True, text=True)
    assert result.returncode == 1 and f"{bad}: not a plan record: model.name: Field required" in result.stderr


@pytest.mark.parametrize("key", ["ckpt/../../etc/cron.d/x", "ckpt//config.json", "ckpt/./a", "ckpt/a\\..\\b"])
def test_object_keys_that_could_leave_the_target_are_refused(key: str) -> None:
    """Regression: a bucket's key became a path under the target directory as it was."""
    from installer.remote_source import RemoteSourceError, relative_key

    assert relative_key("ckpt/sub/model.safetensors", "ckpt/") == "sub/model.safetensors"
    with pytest.raises(RemoteSourceError, match="not a plain relative path"):
        relative_key(key, "ckpt/")


@pytest.mark.parametrize("host", ["../../etc", "a/b", ".hidden", "node..1", ""])
def test_a_plan_whose_host_names_are_not_plain_names_is_refused(tmp_path: Path, host: str) -> None:
    """A plan's host name becomes the staging directory out_dir/<host>."""
    from pydantic import ValidationError

    from appliance.records import HostCommand

    assert HostCommand(host="gpu-01.rack_2", role="head", argv=[], env={}).host == "gpu-01.rack_2"
    with pytest.raises(ValidationError, match="host"):
        HostCommand(host=host, role="head", argv=[], env={})
