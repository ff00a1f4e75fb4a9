"""Preflight: each check's pass, warn and fail, with its reason in numbers; and the
`appliance profile` and `appliance preflight` commands run for real."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from appliance.home import Home
from appliance.records import Gpu, HardwareProfile, Host
from appliance.supervisor import ProcessInfo, ProcessState
from installer import preflight as checks_module
from installer.hardware import load_profile
from installer.preflight import MIN_RAM_BYTES, Check, run_checks
from tests.support.appliances import Appliance, make_appliance
from tests.support.ports import free_port

GIB = 2**30
EXAMPLE = Path(__file__).parents[2] / "installer" / "profiles" / "example-2x8xH100.toml"


def gpu(index: int, **fields: Any) -> Gpu:
    return Gpu(index=index, name=fields.pop("name", "NVIDIA H100 80GB HBM3"), memory_bytes=80 * GIB, **fields)


def host(name: str = "node-a", gpus: int = 8, **fields: Any) -> Host:
    fields.setdefault("cuda_version", "12.8")
    fields.setdefault("driver_version", "570.124.06")
    fields.setdefault("ram_bytes", 1024 * GIB)
    return Host(name=name, gpus=fields.pop("gpu_list", None) or [gpu(i) for i in range(gpus)], **fields)


@pytest.fixture
def java_home(tmp_path: Path) -> str:
    java = tmp_path / "jdk" / "bin" / "java"
    java.parent.mkdir(parents=True)
    java.write_text("#!/bin/sh\n")
    java.chmod(0o755)
    return str(tmp_path / "jdk")


def checks(profile: HardwareProfile | Host, tmp_path: Path, **kwargs: Any) -> dict[str, Check]:
    """Run every check with passing defaults; `kwargs` overrides one argument."""
    if isinstance(profile, Host):
        profile = HardwareProfile(hosts=[profile])
    arguments: dict[str, Any] = {"model_bytes": GIB, "staging_dir": tmp_path, "ports": [free_port()],
                                 "java_home": kwargs.pop("java_home", None), "engine": "cuda", "engine_cuda": (12, 8)}
    arguments.update(kwargs)
    return {check.name: check for check in run_checks(profile, **arguments)}


def test_a_healthy_host_passes_every_check(tmp_path: Path, java_home: str) -> None:
    result = checks(HardwareProfile(hosts=[host("node-a"), host("node-b")]), tmp_path, java_home=java_home)
    assert [c.name for c in result.values()] == [
        "gpus", "engine", "gpu types", "gpu memory health", "mig", "cuda driver", "disk", "ram", "ports", "java"]
    assert {c.status for c in result.values()} == {"pass"}, result
    assert result["gpus"].reason == "16 GPUs on 2 host(s)"
    assert result["cuda driver"].reason == "CUDA 12.8 >= 12.8"


def test_no_gpu_warns_and_needs_no_driver(tmp_path: Path) -> None:
    result = checks(host(gpus=0, cuda_version=None), tmp_path)
    assert result["gpus"].status == "warn"
    assert result["gpus"].reason == "no NVIDIA GPU: the CPU engine will be used"
    assert result["gpus"].fix
    assert result["cuda driver"].status == "skip"
    # Nothing to check on no GPU: the GPU checks say so rather than claim the GPUs are fine.
    assert result["mig"].reason == result["gpu memory health"].reason == "skipped (no GPU)"
    assert result["mig"].status == result["gpu memory health"].status == "skip"


def test_unreadable_gpu_fails(tmp_path: Path) -> None:
    result = checks(host(gpu_errors=["GPU 3: GPU is lost"]), tmp_path)
    assert result["gpus"].status == "fail"
    assert "node-a: GPU 3: GPU is lost" in result["gpus"].reason


def test_mixed_gpu_types_on_a_host_fail(tmp_path: Path) -> None:
    mixed = [gpu(0), gpu(1), gpu(2, name="NVIDIA A100-SXM4-80GB")]
    result = checks(HardwareProfile(hosts=[host("node-a", gpu_list=mixed), host("node-b")]), tmp_path)
    check = result["gpu types"]
    assert check.status == "fail" and check.fix
    assert check.reason == "node-a has 2 x NVIDIA H100 80GB HBM3, 1 x NVIDIA A100-SXM4-80GB"


def test_ecc_errors_and_pending_remaps_fail(tmp_path: Path) -> None:
    bad = [gpu(0), gpu(1, ecc_errors=2), gpu(2, remapped_rows_pending=True)]
    check = checks(host(gpu_list=bad), tmp_path)["gpu memory health"]
    assert check.status == "fail" and "nvidia-smi -r" in (check.fix or "")
    assert check.reason == "node-a GPU 1: 2 uncorrected ECC errors; node-a GPU 2: row remapping pending"


def test_mig_warns(tmp_path: Path) -> None:
    check = checks(host(gpu_list=[gpu(0, mig_enabled=True), gpu(1)]), tmp_path)["mig"]
    assert (check.status, check.reason) == ("warn", "MIG enabled on node-a GPU 0")


@pytest.mark.parametrize(("cuda", "status", "said"), [
    ("12.4", "fail", "node-a: driver 570.124.06 supports CUDA 12.4; the engine needs CUDA 12.8"),
    ("11.8", "fail", "supports CUDA 11.8"),
    ("12.9", "pass", "CUDA 12.9 >= 12.8"),
    ("13.0", "pass", "CUDA 13.0 >= 12.8"),
    (None, "warn", "CUDA version unknown on node-a"),
])
def test_cuda_driver_against_the_engine(tmp_path: Path, cuda: str | None, status: str, said: str) -> None:
    check = checks(host(cuda_version=cuda), tmp_path)["cuda driver"]
    assert check.status == status and said in check.reason


def test_the_driver_is_checked_against_the_installed_builds_cuda(tmp_path: Path) -> None:
    check = checks(host(cuda_version="12.8"), tmp_path, engine_cuda=(13, 0))["cuda driver"]
    assert check.status == "fail" and "the engine needs CUDA 13.0" in check.reason and "R580" in (check.fix or "")
    assert checks(host(cuda_version="13.0"), tmp_path, engine_cuda=(13, 0))["cuda driver"].status == "pass"
    assert checks(host(cuda_version="11.8"), tmp_path, engine="cpu")["cuda driver"].status == "pass"


@pytest.mark.parametrize(("engine", "gpus", "status", "said"), [
    ("cuda", 8, "pass", "the CUDA engine fits the GPU hosts"),
    ("cpu", 0, "pass", "the CPU engine fits hosts without GPUs"),
    ("cuda", 0, "fail", "the CUDA engine is installed, but node-a has no NVIDIA GPU or driver"),
    ("cpu", 8, "warn", "the CPU engine is installed: the GPUs of node-a go unused"),
    (None, 0, "fail", "no vLLM engine is installed"),
])
def test_the_installed_engine_fits_the_host(tmp_path: Path, engine: str | None, gpus: int, status: str,
                                            said: str) -> None:
    check = checks(host(gpus=gpus), tmp_path, engine=engine)["engine"]
    assert (check.status, check.reason) == (status, said)


def test_disk_too_small_for_the_model_fails_with_numbers(tmp_path: Path) -> None:
    check = checks(host(), tmp_path, model_bytes=2**60)["disk"]
    assert check.status == "fail"
    assert f"free at {tmp_path}; the model needs 1073741824.0 GiB + 10% = 1181116006.4 GiB" in check.reason
    assert "APPLIANCE_HOME" in (check.fix or "")


def test_disk_is_checked_where_the_staging_dir_will_be(tmp_path: Path) -> None:
    check = checks(host(), tmp_path, staging_dir=tmp_path / "not" / "yet", model_bytes=GIB)["disk"]
    assert check.status == "pass" and "the model needs 1.0 GiB + 10% = 1.1 GiB" in check.reason
    unsized = checks(host(), tmp_path, model_bytes=None)["disk"]
    assert unsized.status == "pass" and "no model size given" in unsized.reason


def test_little_or_unknown_ram_warns(tmp_path: Path) -> None:
    low = checks(host(ram_bytes=8 * GIB), tmp_path)["ram"]
    assert (low.status, low.reason) == ("warn", "node-a: 8.0 GiB, below 16.0 GiB")
    unknown = checks(host(ram_bytes=None), tmp_path)["ram"]
    assert (unknown.status, unknown.reason) == ("warn", "RAM not known for node-a")
    enough = checks(host(ram_bytes=MIN_RAM_BYTES), tmp_path)["ram"]
    assert enough.status == "pass"


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def test_a_taken_port_fails_and_says_which(tmp_path: Path, busy_port: int) -> None:
    free = free_port()
    check = checks(host(), tmp_path, ports=[free, busy_port, free])["ports"]
    assert check.status == "fail"
    assert check.reason == f"cannot listen on 127.0.0.1: {busy_port} (in use); 2 ports needed"
    assert checks(host(), tmp_path, ports=[free])["ports"].reason == f"free on 127.0.0.1: {free}"


class RunningAppliance:
    """supervisord of an appliance that runs, as appliance_ports asks it: these programs and pids."""

    def __init__(self, programs: dict[str, int]) -> None:
        self.programs = programs

    def __call__(self, home: Home) -> RunningAppliance:
        return self

    def is_running(self) -> bool:
        return True

    def processes(self) -> list[ProcessInfo]:
        return [ProcessInfo(name=name, state=ProcessState.RUNNING, pid=pid, uptime_s=60, log=Path("/dev/null"),
                            description="") for name, pid in self.programs.items()]


@pytest.fixture
def listener_child() -> Iterator[int]:
    """A child process of this one listening on a port, as a program's own child (an engine's) would."""
    code = ("import socket, sys, time\ns = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
            "print(s.getsockname()[1], flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        yield int(child.stdout.readline())
    finally:
        child.kill()
        child.wait()


def test_ports_the_running_appliance_holds_are_no_conflict(tmp_path: Path, home: Home, busy_port: int,
                                                          listener_child: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # This test process and the child it started stand for two programs of a running appliance.
    monkeypatch.setattr(checks_module, "Supervisor", RunningAppliance({"gateway": os.getpid(), "stopped": 0}))
    free = free_port()
    check = checks(host(), tmp_path, ports=[busy_port, free, listener_child], home=home)["ports"]
    assert check.status == "pass", check
    assert check.reason == (f"free on 127.0.0.1: {free}; held by this appliance, which is running: "
                            f"{busy_port} (gateway), {listener_child} (gateway)")
    only_ours = checks(host(), tmp_path, ports=[busy_port], home=home)["ports"]
    assert only_ours.reason == f"held by this appliance, which is running: {busy_port} (gateway)"


def test_a_port_held_by_something_else_fails_though_the_appliance_runs(tmp_path: Path, home: Home, busy_port: int,
                                                                       listener_child: int,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checks_module, "Supervisor", RunningAppliance({"keycloak": 999_999_999}))  # no such process
    check = checks(host(), tmp_path, ports=[busy_port], home=home)["ports"]
    assert check.status == "fail" and f"{busy_port} (in use)" in check.reason


def test_an_appliance_that_is_not_running_holds_no_port(home: Home, busy_port: int) -> None:
    assert checks_module.appliance_ports(home) == {}
    assert checks_module.appliance_ports(Home(Path("/tmp") / ("x" * 120))) == {}  # no supervisord could run there


def test_java(tmp_path: Path, java_home: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert checks(host(), tmp_path, java_home=java_home)["java"].status == "pass"
    missing = checks(host(), tmp_path, java_home=str(tmp_path / "nojdk"))["java"]
    assert missing.status == "fail" and missing.reason == f"no java at {tmp_path}/nojdk/bin/java"
    assert "keycloak.java_home" in (missing.fix or "")
    # Keycloak does not look on PATH, so neither does the check.
    monkeypatch.setenv("PATH", f"{java_home}/bin")
    unfound = checks(host(), tmp_path)["java"]
    assert unfound.status == "fail" and unfound.reason.startswith("no JDK where Keycloak looks")
    assert checks(host(), tmp_path, need_java=False)["java"].status == "pass"


# --- the commands --------------------------------------------------------------------------


@pytest.fixture
def appliance() -> Iterator[Appliance]:
    yield from make_appliance(None)


@pytest.mark.integration
def test_profile_json(appliance: Appliance, tmp_path: Path) -> None:
    out = tmp_path / "this-host.json"
    result = appliance.run("profile", "--json", "--out", str(out), timeout=60)
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert printed["source"] == "detected" and len(printed["hosts"]) == 1
    assert printed["hosts"][0]["ram_bytes"] > 0
    assert load_profile(out).model_dump(mode="json") == printed  # --out writes a profile load_profile reads


@pytest.mark.integration
def test_profile_table(appliance: Appliance) -> None:
    result = appliance.run("profile", timeout=60)
    assert result.returncode == 0, result.stderr
    assert "cores" in result.stdout and "RAM" in result.stdout


def preflight(appliance: Appliance, *args: str) -> tuple[int, dict[str, Any]]:
    result = appliance.run("preflight", "--json", *args, timeout=60)
    said = f"exit {result.returncode}\nstdout: {result.stdout!r}\nstderr: {result.stderr}"
    assert result.returncode in (0, 1), said
    try:
        report = json.loads(result.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"`appliance preflight --json` printed no report: {said}")
    assert result.returncode == (0 if report["ok"] else 1)
    return result.returncode, {check["name"]: check for check in report["checks"]}


@pytest.mark.integration
def test_preflight_on_this_host(appliance: Appliance) -> None:
    code, result = preflight(appliance)
    assert code == 0, result
    assert result["ports"]["status"] == "pass"
    assert str(appliance.port("APPLIANCE_GATEWAY__PORT")) in result["ports"]["reason"]
    assert result["java"]["reason"] == "Keycloak is external: no Java needed"


@pytest.mark.integration
def test_preflight_fails_on_a_taken_port(appliance: Appliance) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", appliance.port("APPLIANCE_GATEWAY__PORT")))
        listener.listen()
        code, result = preflight(appliance)
        table = appliance.run("preflight", timeout=60)
    assert code == 1
    assert f"{appliance.port('APPLIANCE_GATEWAY__PORT')} (in use)" in result["ports"]["reason"]
    assert table.returncode == 1 and "fail" in table.stdout and "in use" in table.stdout


@pytest.mark.integration
def test_preflight_of_a_cluster_profile(appliance: Appliance) -> None:
    code, result = preflight(appliance, "--profile", str(EXAMPLE), "--model-bytes", str(GIB))
    assert code == 0, result
    assert result["gpus"]["reason"] == "16 GPUs on 2 host(s)"


@pytest.mark.integration
def test_preflight_of_a_bad_profile_is_one_line(appliance: Appliance, tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[[hosts]]\nname = "node-a"\nram = 1\n')
    result = appliance.run("preflight", "--profile", str(bad), timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        (f"error: {bad}: hosts.node-a.ram: Extra inputs are not permitted (got 1); "
         "see installer/profiles/example-2x8xH100.toml")]
