"""GPU figures from NVML: through pynvml's own C calls into a stand-in driver library
(tests/support/fake_nvml.c), into the gateway's /metrics and the dashboards' /admin/system."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.errors import SettingsError
from appliance.home import Home
from appliance.programs import Program
from appliance.settings import load_settings
from tests.support.nvml import build_fake_nvml, gpu_metrics, in_own_process

USAGE = ("import sys; from appliance.usage import host_usage; "
         "sys.stdout.write(host_usage(sys.argv[1] or None).model_dump_json())")


@pytest.fixture(scope="module")
def fake_nvml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    library = build_fake_nvml(tmp_path_factory.mktemp("nvml"))
    library.chmod(0o755)
    return library


def scrape(home: Home, library: Path | str | None) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(gpu_metrics(home.root, library)) for sample in family.samples}


def at(gpu: int, **labels: str) -> frozenset[tuple[str, str]]:
    return frozenset({"gpu": str(gpu), "pool": "main" if gpu == 0 else "", **labels}.items())


def test_each_gpu_figure_reaches_the_metrics_with_the_pool_that_holds_it(home: Home, fake_nvml: Path) -> None:
    engine = Program(name="vllm-main_0", command=["vllm"], pool="main", gpus=[0])
    (home.run / "programs.json").write_text(json.dumps([engine.model_dump(mode="json")]))
    figures = scrape(home, fake_nvml)
    assert figures[("appliance_gpu_nvml_up", frozenset())] == 1
    assert figures[("appliance_gpu_info", at(0, name="Fake H200", uuid="GPU-fake-0"))] == 1
    assert figures[("appliance_gpu_utilization_ratio", at(0))] == 0.87
    assert figures[("appliance_gpu_memory_used_bytes", at(0))] == 144e9
    assert figures[("appliance_gpu_memory_total_bytes", at(1))] == 150e9
    assert figures[("appliance_gpu_temperature_celsius", at(0))] == 71
    assert figures[("appliance_gpu_power_watts", at(0))] == 412.5
    assert ("appliance_gpu_power_watts", at(1)) not in figures  # the board does not report it: no series
    assert figures[("appliance_gpu_ecc_errors_total", at(1, kind="uncorrected"))] == 2
    assert figures[("appliance_gpu_ecc_errors_total", at(0, kind="corrected"))] == 17
    assert figures[("appliance_gpu_slowdown", at(0, reason="sw_power_cap"))] == 1
    assert figures[("appliance_gpu_slowdown", at(0, reason="hw_thermal"))] == 0  # application clocks: normal
    assert figures[("appliance_gpu_slowdown", at(1, reason="sw_power_cap"))] == 0  # idle is no slowdown
    names = {name for name, _ in figures}
    # Neither call is in the library: no series.
    assert not names & {"appliance_gpu_retired_pages", "appliance_gpu_remapped_rows_uncorrectable"}


def test_without_nvml_there_are_no_gpu_figures_and_the_reason_is_given(home: Home, tmp_path: Path,
                                                                         fake_nvml: Path) -> None:
    writable = tmp_path / "libnvidia-ml.so.1"
    writable.write_bytes(fake_nvml.read_bytes())
    writable.chmod(0o777)  # another local user could put code in the gateway
    shared = tmp_path / "shared"  # ...or swap a good library in a directory anyone may write
    shared.mkdir()
    (shared / "libnvidia-ml.so.1").write_bytes(fake_nvml.read_bytes())
    shared.chmod(0o777)
    link = tmp_path / "link.so"  # a link is followed to what it names, and that is checked
    link.symlink_to(writable)
    for library in (None, tmp_path / "missing.so", writable, shared / "libnvidia-ml.so.1", link):
        # None: this host's own (it has no GPU driver)
        figures = scrape(home, library)
        assert figures == {("appliance_gpu_nvml_up", frozenset()): 0}, library
    usage = json.loads(in_own_process(USAGE, home.root, writable))
    assert usage["gpus"] == [] and "writable by others" in usage["gpu_error"]
    assert "NVML" in json.loads(in_own_process(USAGE, home.root, None))["gpu_error"]


def test_the_dashboards_read_the_same_figures(home: Home, fake_nvml: Path, tmp_path: Path) -> None:
    driver = tmp_path / "libnvidia-ml.so.1"  # as drivers install it: a link to the versioned file
    driver.symlink_to(fake_nvml)
    usage = json.loads(in_own_process(USAGE, home.root, driver))
    first, second = usage["gpus"]
    assert (first["name"], first["utilization_percent"], first["power_watts"], first["slowdowns"]) == (
        "Fake H200", 87, 412.5, ["sw_power_cap"])
    assert (second["power_watts"], second["ecc_uncorrected"], second["retired_pages"]) == (None, 2, None)
    assert usage["gpu_error"] is None


@pytest.mark.parametrize("path", ["lib/libnvidia-ml.so.1", "/usr/lib/../tmp/x.so", "/usr/lib/x.so\n",
                                  "/usr/lib/\u2024\u2024/x.so", "/" + "a" * 4096])
def test_an_nvml_library_setting_must_be_a_plain_absolute_path(home: Home, path: str) -> None:
    with pytest.raises(SettingsError, match="nvml_library"):
        load_settings(home.settings_file, environ={"APPLIANCE_MONITORING__NVML_LIBRARY": path})
