"""The weights a worker's ranks load. A pool serving a subset staged for its plan
(`appliance stage`: OUT/<host>/) sends each worker the subset staged for that worker, never the
head's own (the layers of another pipeline stage); a missing one is refused, naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.engine_launch import PoolLayout
from appliance.errors import Invalid
from appliance.home import Home
from appliance.hosts import weight_files
from appliance.records import Gpu, HardwareProfile, Host
from appliance.settings import PoolSettings
from appliance.staging_manifest import StagingManifest
from installer.memory import GIB
from installer.model_config import load_model_config
from installer.planner import Pins, plan
from serve.cluster_weights import weights_dir
from serve.engine import SpanningPool
from tests.support.models import MODEL_CONFIGS


def span(model: Path) -> SpanningPool:
    profile = HardwareProfile(hosts=[Host(name=name, nvlink_all_to_all=True,
                                          gpus=[Gpu(index=i, name="H100", memory_bytes=80 * GIB) for i in range(4)])
                                     for name in ("head", "worker-1")])
    record = plan(load_model_config(MODEL_CONFIGS / "mixtral-8x22b.json"), profile, context=8192, concurrency=1,
                  pins=Pins(tp=8))
    return SpanningPool(PoolSettings(name="big", model=str(model)), record, PoolLayout(8, 1, 1, False, 8192, 2))


def staged(directory: Path, host: str, complete: bool = True) -> Path:
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(host.encode() * 100)
    StagingManifest(source="/models/M", config_sha256="0" * 64, host=host, layers=(0, 56),
                    complete=complete).save(directory)
    return directory


def test_a_worker_gets_its_own_staged_subset(tmp_path: Path, home: Home) -> None:
    head = staged(tmp_path / "out" / "head", "head")
    own = staged(tmp_path / "out" / "worker-1", "worker-1")
    assert weights_dir(span(head), home, "worker-1") == own
    files = {f.path: f for f in weight_files(own)}
    assert files["model.safetensors"].bytes == len(b"worker-1") * 100


@pytest.mark.parametrize("problem", ["missing", "incomplete", "another host's"])
def test_a_missing_or_partial_subset_is_refused_naming_it(tmp_path: Path, home: Home, problem: str) -> None:
    head = staged(tmp_path / "out" / "head", "head")
    if problem == "incomplete":
        staged(tmp_path / "out" / "worker-1", "worker-1", complete=False)
    elif problem == "another host's":
        staged(tmp_path / "out" / "worker-1", "head")
    with pytest.raises(Invalid, match=f"{tmp_path / 'out' / 'worker-1'} holds no complete subset staged for worker-1"):
        weights_dir(span(head), home, "worker-1")


def test_a_plain_checkpoint_goes_whole_and_links_are_not_served(tmp_path: Path, home: Home) -> None:
    model = tmp_path / "M"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "secret-link").symlink_to("/etc/hostname")
    (model / "linked-dir").symlink_to("/etc", target_is_directory=True)
    assert weights_dir(span(model), home, "worker-1") == model
    assert [f.path for f in weight_files(model)] == ["config.json"]
