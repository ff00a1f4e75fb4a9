"""The TUI's pure parts: gateway rates from two /metrics scrapes, plan and evaluation text, the
admin client's error mapping, host usage from NVML, and a staged directory's summary."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client import generate_latest

from appliance import usage
from appliance.adapters import Alias
from appliance.admin_client import AdminClient, NotLoggedIn, Refused, Unreachable
from appliance.home import Home
from appliance.roles import Role
from appliance.settings import Settings
from installer.hardware import parse_hardware_spec
from installer.model_config import load_model_config
from installer.planner import plan
from installer.staging import stage_subset
from serve.metrics import Metrics
from serve.response_cache import CacheStats
from serve.routes.plans import staging_of
from tests.support.records import metrics
from tui.metrics import parse, quantile, rates
from tui.models import plan_text
from tui.training import eval_summary, served


def test_rates_count_only_v1_traffic_between_two_scrapes() -> None:
    metrics = Metrics()
    before = parse(generate_latest(metrics.registry).decode(), at=10.0)
    for seconds in [0.02] * 8 + [0.3, 3.0]:  # ten chat requests
        metrics.requests.labels("/v1/chat/completions", "200", "user").inc()
        metrics.latency.labels("/v1/chat/completions").observe(seconds)
    metrics.requests.labels("/v1/chat/completions", "503", "user").inc()
    metrics.requests.labels("/v1/models", "401", "none").inc()
    for _ in range(50):  # the TUI's own polling is not load
        metrics.requests.labels("/admin/services", "200", "admin").inc()
        metrics.latency.labels("/admin/services").observe(0.001)
    metrics.tokens.labels("in", "m").inc(100)
    metrics.tokens.labels("out", "m").inc(40)
    after = parse(generate_latest(metrics.registry).decode(), at=12.0)
    now = rates(before, after)
    assert now.requests_per_s == pytest.approx(12 / 2)
    assert (now.errors_per_s, now.refused_per_s) == (pytest.approx(0.5), pytest.approx(0.5))
    assert (now.tokens_in_per_s, now.tokens_out_per_s) == (50, 20)
    assert 0.01 < now.p50_s <= 0.025  # eight of ten in the 10-25 ms bucket
    assert 2.5 < now.p99_s <= 5
    idle = rates(after, parse(generate_latest(metrics.registry).decode(), at=14.0))
    assert idle.requests_per_s == 0 and idle.p50_s is None


def test_quantile_interpolates_within_buckets_and_stops_at_the_last_finite_bound() -> None:
    assert quantile(0.5, {0.1: 0, 0.2: 10, float("inf"): 10}) == pytest.approx(0.15)
    assert quantile(0.99, {0.1: 0, 0.2: 1, float("inf"): 10}) == 0.2
    assert quantile(0.5, {}) is None


def test_plan_text_names_layout_memory_rejections_and_staging(demo_model: Path, tmp_path: Path) -> None:
    record = plan(load_model_config(demo_model), parse_hardware_spec("1x4xL4-24GB"), context=2048, concurrency=1,
                  model_ref=str(demo_model))
    [staged] = stage_subset(demo_model, record, tmp_path)
    view = {"pool": "main", "model_dir": str(staged.directory), "plan": json.loads(record.model_dump_json()),
            "staging": staging_of(staged.directory).model_dump()}
    text = plan_text(view)
    layout = record.layout
    assert f"Layout: TP{layout.tp} PP{layout.pp} DP{layout.dp}" in text
    assert "Per GPU: weights" in text and "KV capacity" in text
    assert all(r.reason in text for r in record.rejected)
    assert "complete" in text and "INCOMPLETE" not in text
    assert "Plan: none" in plan_text({"pool": "main", "model_dir": "/m", "plan": None, "staging": None})
    assert staging_of(tmp_path / "nothing-here") is None


def test_adapter_rows_say_what_is_served_and_how_it_evaluated() -> None:
    aliases = {"a": Alias(pool="main", roles=[Role.USER], stable=1, canary=2, canary_share=0.25)}
    assert [served("a", v, aliases) for v in (1, 2, 3)] == ["stable", "canary 25%", ""]
    assert served("b", 1, aliases) == ""
    scored = metrics(base_eval_loss=2.0, adapter_eval_loss=1.5, eval_sets={"scenario": {"base": 0.1, "adapter": 0.9}},
                     gate_failures=["scenario score 0.90 < 0.95"])
    assert eval_summary(scored) == "loss 2.000->1.500, scenario 0.10->0.90, gate: scenario score 0.90 < 0.95"


def client_with(tmp_path: Path, handler: httpx.MockTransport | None, token: bool = True) -> AdminClient:
    home = Home(tmp_path / "h").ensure()
    if token:
        (home.secrets / "cli-token.json").write_text(json.dumps({
            "username": "admin", "access_token": "a.b.c", "refresh_token": "r", "expires_at": 4e9,
            "refresh_expires_at": 4e9}))
    client = AdminClient(Settings(), home)
    if handler is not None:
        client._http = httpx.AsyncClient(base_url=client.base_url, transport=handler)
    return client


def test_client_maps_answers_to_errors_the_screens_show(tmp_path: Path) -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == "Bearer a.b.c"
        return {"/admin/ok": httpx.Response(200, json=[1]),
                "/admin/conflict": httpx.Response(409, json={"error": {"message": "the gateway cannot stop itself"}}),
                "/admin/expired": httpx.Response(401, json={"error": {"message": "expired"}})}[request.url.path]

    client = client_with(tmp_path, httpx.MockTransport(answer))

    async def calls() -> None:
        assert await client.call("GET", "/ok") == [1]
        with pytest.raises(Refused, match="cannot stop itself") as refused:
            await client.call("POST", "/conflict")
        assert refused.value.status == 409
        with pytest.raises(NotLoggedIn):
            await client.call("GET", "/expired")

    asyncio.run(calls())
    down = client_with(tmp_path / "down", None)  # nothing listens on the default gateway port here
    down._http = httpx.AsyncClient(base_url="http://127.0.0.1:9")
    with pytest.raises(Unreachable, match="does not answer"):
        asyncio.run(down.call("GET", "/services"))
    with pytest.raises(NotLoggedIn, match="not logged in"):
        asyncio.run(client_with(tmp_path / "none", None, token=False).call("GET", "/services"))


def test_host_usage_reads_each_gpu_from_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    class Fake:
        NVMLError = type("NVMLError", (Exception,), {})
        NVML_TEMPERATURE_GPU = 0
        nvmlInit = nvmlShutdown = staticmethod(lambda: None)
        nvmlDeviceGetCount = staticmethod(lambda: 2)
        nvmlDeviceGetHandleByIndex = staticmethod(lambda i: i)
        nvmlDeviceGetName = staticmethod(lambda h: b"NVIDIA H200")
        nvmlDeviceGetMemoryInfo = staticmethod(lambda h: SimpleNamespace(used=(h + 1) * 2**30, total=141 * 2**30))
        nvmlDeviceGetUtilizationRates = staticmethod(lambda h: SimpleNamespace(gpu=50 + h))

        @staticmethod
        def nvmlDeviceGetTemperature(handle: int, sensor: int) -> int:
            if handle == 1:
                raise Fake.NVMLError("not supported")
            return 41

    monkeypatch.setattr(usage, "pynvml", Fake)
    found = usage.host_usage()
    assert [(g.name, g.utilization_percent, g.memory_used_bytes, g.temperature_c) for g in found.gpus] == [
        ("NVIDIA H200", 50, 2**30, 41), ("NVIDIA H200", 51, 2 * 2**30, None)]
    assert found.gpu_error is None and found.memory_total_bytes > 0

    def no_driver() -> None:
        raise Fake.NVMLError("NVML Shared Library Not Found")

    monkeypatch.setattr(Fake, "nvmlInit", staticmethod(no_driver))
    found = usage.host_usage()
    assert found.gpus == [] and "NVML Shared Library Not Found" in (found.gpu_error or "")


def test_screens_answer_keys_while_an_admin_call_is_still_pending(home: Home) -> None:
    """Every call runs in a worker: the app switches screens while the gateway has not answered."""
    from tui.app import AdminApp

    release = asyncio.Event()
    asked: list[str] = []

    class Stalled:
        base_url = "http://127.0.0.1:9"

        async def username(self) -> str:
            return "admin"

        async def call(self, method: str, path: str, **kwargs: object) -> object:
            asked.append(path)
            await release.wait()
            if path == "/batches":
                return {"object": "list", "data": []}
            if path == "/cache":
                return CacheStats(enabled=True, scope="user", entries=0, bytes=0, max_entries=1, max_bytes=1,
                                  ttl_s=1, hits=0, misses=0, bypasses=0, hit_rate=None).model_dump()
            return usage.host_usage().model_dump() if path == "/system" else []

        async def metrics_text(self) -> str:
            await release.wait()
            return ""

        async def close(self) -> None:
            pass

    app = AdminApp(Settings(), home)
    app.client = Stalled()  # type: ignore[assignment]

    async def scenario() -> None:
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause(0.3)
            assert "/services" in asked and not release.is_set()
            for key, screen in (("m", "Models"), ("u", "Users"), ("d", "Dashboard")):
                await pilot.press(key)
                assert type(app.screen).__name__ == screen
            release.set()
            await pilot.pause(0.3)

    asyncio.run(scenario())


HOSTILE = "[/x] [link=https://example.invalid]click[/link] [bold red]"


def test_values_from_the_appliance_are_shown_as_text_never_as_markup(home: Home) -> None:
    """Issue 17: an audit record whose resource is `[/x]` crashed the audit screen (DataTable reads
    a str as Rich markup); the chain's verdict, a refusal and the detail view show such text too."""
    from textual.widgets import DataTable, Static

    from tui.app import AdminApp

    record = {"seq": 7, "time": "2026-12-01T03:00:00.000000Z", "username": HOSTILE, "action": HOSTILE,
              "outcome": "denied", "status": 401, "resource": HOSTILE}

    class Hostile:
        base_url = "http://127.0.0.1:9"

        async def username(self) -> str:
            return HOSTILE

        async def call(self, method: str, path: str, **kwargs: object) -> object:
            if path == "/audit/verify":
                return {"ok": False, "where": HOSTILE, "reason": HOSTILE}
            if path == "/audit":
                return [record]
            if path == "/system":
                return usage.host_usage().model_dump()
            raise Refused(403, HOSTILE)

        async def metrics_text(self) -> str:
            return ""

        async def close(self) -> None:
            pass

    app = AdminApp(Settings(), home)
    app.client = Hostile()  # type: ignore[assignment]

    async def scenario() -> None:
        async with app.run_test(size=(160, 40)) as pilot:
            for key in ("u", "m", "j", "d", "a"):
                await pilot.press(key)
                await pilot.pause(0.3)
            table = app.screen.query_one("#records", DataTable)
            assert table.row_count == 1
            assert str(table.get_row_at(0)[5]) == HOSTILE, "shown as written, not styled"
            await pilot.press("v")
            await pilot.pause(0.3)
            chain = app.screen.query_one("#chain", Static)
            assert HOSTILE in str(chain.render())
            await pilot.press("enter")  # the record's detail view
            await pilot.pause(0.3)
            assert type(app.screen).__name__ == "Detail"

    asyncio.run(scenario())
