"""The CLI's listings keep every id whole (batch ids, key names and prefixes, owners, dates,
dataset and adapter names, hashes) at 80 columns and narrower: what people copy is never
wrapped, cut or shortened; text columns wrap, or are left out with a note. Each listing is drawn
from a fake admin API answer (or registry) with long realistic ids."""

from __future__ import annotations

import io
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

import finetune.cli
from appliance.adapters import AdapterRecord, AdapterState, Registry
from appliance.commands import adapters, alerts, keys, serving, users
from appliance.jobs import Hyperparameters
from appliance.terminal import Listing, text
from tests.support.records import metrics

HASH = "9c56cc51b374c3ba189210d5b6d4bf57790d351c96c47c02190ecf1e430635ab"
BATCH = "batch_3f9a1c0e5d7b2a4c6e8f0a1b"
KEY = "ci-pipeline-nightly-evaluation"
PREFIX = "ak_7Hq2Zp"
OWNER = "svc-data-platform-ingest"
EXPIRES = "2027-03-31 23:59"
ADAPTER = "support-tickets-triage-de"
DATASET = "helpdesk-tickets-2026-q3-cleaned"
WIDTHS = [80, 60]


def drawn(monkeypatch: pytest.MonkeyPatch, module: Any, width: int, run: Callable[[], None]) -> str:
    """What `run` prints through `module.out` on a terminal `width` columns wide."""
    buffer = io.StringIO()
    monkeypatch.setattr(module, "out", Console(file=buffer, width=width, color_system=None))
    run()
    return buffer.getvalue()


def answering(monkeypatch: pytest.MonkeyPatch, module: Any, answer: Any) -> None:
    monkeypatch.setattr(module, "admin_api", lambda *args, **kwargs: answer)


def assert_whole(output: str, *ids: str) -> None:
    lines = output.splitlines()
    for value in ids:
        assert any(value in line for line in lines), f"{value!r} is not whole in:\n{output}"


@pytest.mark.parametrize("width", WIDTHS)
def test_batches_list_keeps_batch_ids_owners_and_dates_whole(monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    batch = {"id": BATCH, "owner": OWNER, "status": "in_progress", "endpoint": "/v1/chat/completions",
             "created_at": 1796000000, "request_counts": {"completed": 1200, "failed": 3, "total": 5000}}
    answering(monkeypatch, serving, {"data": [batch]})
    output = drawn(monkeypatch, serving, width, lambda: serving.batches_list(as_json=False, limit=20))
    assert_whole(output, BATCH, OWNER, "/v1/chat/completions", "2026-11-30 00:53:20", "in_progress")


@pytest.mark.parametrize("width", WIDTHS)
def test_keys_list_keeps_names_prefixes_owners_and_expiry_whole(monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    key = {"name": KEY, "prefix": PREFIX, "owner": OWNER, "state": "active", "created": "2026-12-01T09:30:00Z",
           "expires": "2027-03-31T23:59:00Z", "last_used": "2026-12-06T20:01:00Z"}
    answering(monkeypatch, keys, [key])
    output = drawn(monkeypatch, keys, width, lambda: keys.keys_list(user=None, json=False))
    assert_whole(output, KEY, PREFIX, OWNER, EXPIRES, "2026-12-01 09:30", "2026-12-06 20:01")


@pytest.mark.parametrize("width", WIDTHS)
def test_users_list_keeps_user_names_whole(monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    answering(monkeypatch, users, [{"username": OWNER, "enabled": True, "roles": ["admin", "trainer", "auditor"]}])
    output = drawn(monkeypatch, users, width, lambda: users.users_list(as_json=False))
    assert_whole(output, OWNER, "admin", "trainer", "auditor")


@pytest.mark.parametrize("width", WIDTHS)
def test_adapters_list_keeps_adapter_and_dataset_names_whole(monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    record = AdapterRecord(name=ADAPTER, version=12, base_model="Qwen2.5-Coder-32B-Instruct-AWQ",
                           base_config_sha256=HASH, dataset=DATASET, dataset_sha256=HASH,
                           hyperparameters=Hyperparameters(), metrics=metrics(), artifact=f"adapters/{ADAPTER}/12",
                           state=AdapterState.DEPLOYED)
    answering(monkeypatch, adapters, Registry(adapters=[record]).model_dump(mode="json"))
    output = drawn(monkeypatch, adapters, width, lambda: adapters.adapters_list(as_json=False))
    assert_whole(output, ADAPTER, DATASET, "Qwen2.5-Coder-32B-Instruct-AWQ")


@pytest.mark.parametrize("width", WIDTHS)
def test_alerts_keep_names_and_times_whole(monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    alert = {"name": "EngineReplicaDown", "severity": "page", "since": "2026-12-06T20:01:02Z",
             "labels": {"pool": "main", "replica": "main-0"},
             "summary": "Replica main-0 of pool main has not answered its health check for five minutes."}
    answering(monkeypatch, alerts, [alert])
    output = drawn(monkeypatch, alerts, width, lambda: alerts.alerts(json=False))
    assert_whole(output, "EngineReplicaDown", "2026-12-06 20:01:02")


@pytest.mark.parametrize("width", WIDTHS)
def test_data_list_keeps_names_and_hashes_whole(monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    monkeypatch.setattr(finetune.cli, "load_registry", lambda home: {DATASET: HASH})
    output = drawn(monkeypatch, finetune.cli, width, lambda: finetune.cli.list_datasets(as_json=False))
    assert_whole(output, DATASET, HASH)


@pytest.mark.parametrize("width", WIDTHS)
def test_finetune_status_keeps_adapter_dataset_and_dates_whole(monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    job = SimpleNamespace(id=1042, name=ADAPTER, data=DATASET, state="failed", submitted="2026-12-06T18:44:09Z",
                          message="the held-out loss rose above the base model's: the adapter was not registered")
    monkeypatch.setattr(finetune.cli.jobs, "listing", lambda home: [job])
    monkeypatch.setattr(finetune.cli, "_progress_text", lambda home, found: "step 300/300, loss 1.234, 812 tokens/s")
    output = drawn(monkeypatch, finetune.cli, width,
                   lambda: finetune.cli.status(as_json=False))
    assert_whole(output, "1042", ADAPTER, DATASET, "2026-12-06T18:44:09Z")


def test_text_columns_wrap_then_are_left_out_with_a_note() -> None:
    listing = Listing("name", text("description"))
    listing.add_row(KEY, "a description long enough to need wrapping on any terminal narrower than this line")
    wide = render(listing, 80)
    assert_whole(wide, KEY)
    assert "description" in wide and "left out" not in wide
    narrow = render(listing, len(KEY) + 5)
    assert_whole(narrow, KEY)
    assert "left out at this width: description" in " ".join(narrow.split())


def test_whole_columns_wider_than_the_terminal_become_blocks_of_lines() -> None:
    listing = Listing("batch", "owner", "created")
    listing.add_row(BATCH, OWNER, "2026-12-06 20:01:02")
    blocks = render(listing, 40)
    assert f"batch    {BATCH}" in blocks.splitlines()
    assert_whole(blocks, OWNER, "2026-12-06 20:01:02")
    assert render(listing, 20).splitlines()[:2] == ["batch", BATCH], "an id longer than its line: a line of its own"


def test_markup_in_a_cell_is_shown_as_text() -> None:
    listing = Listing("name")
    listing.add_row("[bold]x[/bold]")
    assert "[bold]x[/bold]" in render(listing, 80)


def test_a_row_of_the_wrong_length_names_the_columns() -> None:
    with pytest.raises(ValueError, match=r"a row of 1 cells for 2 columns \(name, owner\)"):
        Listing("name", "owner").add_row("x")


def render(listing: Listing, width: int) -> str:
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None).print(listing, crop=False)
    return buffer.getvalue()


WATCHDOG = {"name": "Watchdog", "severity": "none", "since": "2026-12-06T08:00:00Z", "labels": {},
            "summary": "The alerting pipeline's heartbeat."}


def test_appliance_alerts_does_not_count_the_heartbeat(monkeypatch: pytest.MonkeyPatch) -> None:
    """As `status` and the TUI: the Watchdog heartbeat is "heartbeat ok", never an alert firing."""
    answering(monkeypatch, alerts, [WATCHDOG])
    assert drawn(monkeypatch, alerts, 80, lambda: alerts.alerts(json=False)) == "alerts: none firing; heartbeat ok\n"
    disk = {**WATCHDOG, "name": "DiskNearFull", "severity": "page", "summary": "The state volume is 95% full."}
    answering(monkeypatch, alerts, [disk, WATCHDOG])
    output = drawn(monkeypatch, alerts, 80, lambda: alerts.alerts(json=False))
    assert "DiskNearFull" in output and "Watchdog" not in output.replace("the Watchdog alert", "")
    assert output.splitlines()[-1].startswith("heartbeat ok")
    answering(monkeypatch, alerts, [])
    assert drawn(monkeypatch, alerts, 80, lambda: alerts.alerts(json=False)) == "alerts: none firing\n"


@pytest.mark.parametrize("width", WIDTHS)
def test_preflight_checks_wrap_their_reasons_between_words(monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    import installer.cli
    from installer import preflight

    check = preflight.Check(name="nvidia-driver-version", status="warn",
                            reason="the driver 535.104.05 is older than CUDA 12.4's minimum 550.54.14",
                            fix="install driver 550 or newer: sudo apt install nvidia-driver-550")
    output = drawn(monkeypatch, installer.cli, width, lambda: installer.cli._print_checks([check]))
    assert_whole(output, "nvidia-driver-version", "535.104.05", "550.54.14", "nvidia-driver-550")
    assert max(map(len, output.splitlines())) <= width


def test_show_canary_shows_a_live_canary_s_share_judged_or_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """During a canary without analysis, its versions and share; with it, the current window too."""
    plain = {"stable": 1, "canary": 2, "canary_share": 0.25, "analysis": None}
    answering(monkeypatch, adapters, plain)
    output = drawn(monkeypatch, adapters, 80, lambda: adapters.adapters_show_canary(ADAPTER, as_json=False))
    assert f"{ADAPTER}: v2 gets 25% of requests, v1 the rest" in output and "not judged" in output
    figures = {"requests": 12, "error_rate": 0.0, "latency_p50_s": 0.5, "ttft_p50_s": None, "success_rate": 0.75,
               "satisfaction": None}
    window = {"stable": 1, "canary": 2, "policy": {"windows": 3}, "passed_windows": 1, "window_left_s": 42.4,
              "stable_figures": {**figures, "requests": 30}, "canary_figures": figures}
    answering(monkeypatch, adapters, {**plain, "analysis": window})
    output = drawn(monkeypatch, adapters, 80, lambda: adapters.adapters_show_canary(ADAPTER, as_json=False))
    assert "v2 against v1: 1 of 3 passing windows so far, 42 s left in this one" in output
    shown = [line.split() for line in output.splitlines()]
    assert [cells[-1] for cells in shown if cells[:1] == ["requests"]] == ["30", "12"]
    assert [cells[-2:] for cells in shown if cells[:1] == ["version"]] == [["v1", "(stable)"], ["v2", "(canary)"]]
