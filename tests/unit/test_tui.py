"""The TUI: its pure parts (gateway rates from two /metrics scrapes, plan and evaluation text, the
admin client's error mapping, host usage from NVML, a staged directory's summary, an audit
record's layout) and every screen against a fake admin API at 80x24: titles and columns whole, the
selection kept across refreshes, empty tables that say what belongs in them, refreshes that resend
their query, and only the actions that apply to the selected row."""

from __future__ import annotations

import asyncio
import io
import json
import re
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from prometheus_client import generate_latest
from rich.console import Console
from textual.app import App
from textual.containers import VerticalScroll
from textual.pilot import Pilot
from textual.widgets import DataTable, Input, Label, Select, Static

from appliance import charts, login, usage
from appliance.adapters import AdapterRecord, AdapterState, Alias
from appliance.admin_client import AdminClient, NotLoggedIn, Refused, Unreachable
from appliance.alerts import Alert
from appliance.canary import CanaryAnalysis
from appliance.home import Home
from appliance.jobs import Hyperparameters, JobReport
from appliance.rl.progress import RunReport
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
from tests.support.tokens import here
from tui.metrics import parse, quantile, rates
from tui.models import plan_text
from tui.panel import Panel, selected_key
from tui.training import eval_summary, rollback_question, served

if TYPE_CHECKING:
    from tui.app import AdminApp


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
    judged = {"a": Alias(pool="main", roles=[Role.USER], stable=1, canary=2, canary_share=0.5,
                         canary_analysis=CanaryAnalysis(windows=3))}
    assert served("a", 2, judged) == "canary 50%, judging starts"
    figures = {"requests": 12, "error_rate": 0.0, "latency_p50_s": 0.5, "ttft_p50_s": None, "success_rate": 0.25,
               "satisfaction": None}
    status = {"passed_windows": 1, "canary_figures": figures, "stable_figures": {**figures, "requests": 10,
                                                                                 "success_rate": 1.0}}
    assert served("a", 2, judged, {"a": status}) == ("canary 50%, judged 1/3, answers 12 vs 10, errors 0% vs 0%, "
                                                     "p50 0.50 s vs 0.50 s, success 25% vs 100%")
    scored = metrics(base_eval_loss=2.0, adapter_eval_loss=1.5, eval_sets={"scenario": {"base": 0.1, "adapter": 0.9}},
                     gate_failures=["scenario score 0.90 < 0.95"])
    assert eval_summary(scored) == "loss 2.000->1.500, scenario 10% -> 90%, gate: scenario score 0.90 < 0.95"


def client_with(tmp_path: Path, handler: httpx.MockTransport | None, token: bool = True) -> AdminClient:
    home = Home(tmp_path / "h").ensure()
    here(home).token_cache.unlink(missing_ok=True)  # one user, one realm: one cache, whichever home
    if token:
        login.save(here(home), login.CachedToken(username="admin", access_token="a.b.c", refresh_token="r",
                                                 expires_at=4e9, refresh_expires_at=4e9))
    client = AdminClient(here(home))
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
    """Regression: an audit record whose resource is `[/x]` crashed the audit screen (DataTable reads
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


# -- every screen against a fake admin API: layout at 80x24, selection, empty tables, offers ----

NO_DRIVER = "NVML unavailable: NVML Shared Library Not Found"
HASH = "9f" * 32


def host(gpu_error: str | None = NO_DRIVER) -> dict[str, Any]:
    return usage.HostUsage(cpu_percent=12.0, cpu_count=4, load_1m=0.5, memory_used_bytes=2**30,
                           memory_total_bytes=8 * 2**30, gpus=[], gpu_error=gpu_error).model_dump()


def alert(name: str, severity: str, **labels: str) -> dict[str, Any]:
    return Alert(name=name, severity=severity, since=datetime(2026, 12, 3, 9, tzinfo=UTC), summary=f"{name} [b]now",
                 labels=labels).model_dump(mode="json")


def chart_series(**points: list[float | None]) -> list[dict[str, Any]]:
    """/charts: every key series, four points each, those named given (the others without samples)."""
    return [charts.Series(name=chart.name, label=chart.label, unit=chart.unit, step_s=300,
                          start=datetime(2026, 12, 3, 9, tzinfo=UTC),
                          points=points.get(chart.name, [None] * 4)).model_dump(mode="json")
            for chart in charts.CHARTS]


def cache_stats() -> dict[str, Any]:
    return CacheStats(enabled=True, scope="user", entries=3, bytes=2**20, max_entries=100, max_bytes=2**30,
                      ttl_s=60, hits=5, misses=7, bypasses=1, hit_rate=5 / 12).model_dump()


# What each read answers on a fresh install: nothing yet.
EMPTY_ANSWERS: dict[str, Any] = {"/services": [], "/system": host(), "/pools": [], "/plans": [],
                                 "/cache": cache_stats(), "/batches": {"object": "list", "data": []}, "/jobs": [],
                                 "/adapters": {"adapters": [], "aliases": {}}, "/rl/tasksets": [], "/rl/runs": [],
                                 "/users": [], "/keys": [], "/audit": [], "/alerts": [], "/charts": chart_series(),
                                 "/datasets": []}


def service(name: str, state: str) -> dict[str, Any]:
    running = state == "RUNNING"
    return {"name": name, "state": state, "pid": 100 if running else 0, "uptime_s": 65 if running else 0,
            "restarts": 0, "log": f"/var/log/{name}.log"}


def replica(name: str) -> dict[str, Any]:
    return {"name": name, "gpus": [], "healthy": True, "taking_requests": True, "in_flight": 0,
            "url": "http://127.0.0.1:8100"}


def batch(batch_id: str, status: str) -> dict[str, Any]:
    return {"id": batch_id, "owner": "alice", "status": status, "endpoint": "/v1/chat/completions",
            "request_counts": {"total": 10, "completed": 4, "failed": 1}}


def job(job_id: int, state: str, name: str = "support-bot") -> dict[str, Any]:
    progress = {"step": 3, "max_steps": 10, "loss": 1.25, "tokens_per_s": 321.0, "eta_s": 42}
    return JobReport.model_validate({
        "id": job_id, "name": name, "data": "tickets", "base": "demo", "hyperparameters": {}, "eval_sets": {},
        "state": state, "submitted": "2026-12-01T03:00:00Z", "started": None, "finished": None, "attempts": 1,
        "worker_pid": None, "trainer_pid": None, "message": None,
        "progress": progress if state == "running" else None}).model_dump(mode="json")


def adapter(name: str, version: int, state: str) -> dict[str, Any]:
    return AdapterRecord(name=name, version=version, base_model="SmolLM2-135M-Instruct", base_config_sha256=HASH,
                         dataset="tickets", dataset_sha256=HASH, hyperparameters=Hyperparameters(),
                         metrics=metrics(), artifact=f"adapters/{name}/{version}",
                         state=AdapterState(state)).model_dump(mode="json")


def rl_run(run_id: int, state: str) -> dict[str, Any]:
    progress = {"tasks": 20, "attempts_done": 30, "attempts_planned": 40, "passed": 12, "pass_rate": 0.6,
                "first_pass_rate": 0.45, "mean_reward": 0.512, "queue_depth": 3, "workers": 4,
                "trajectory_segments": 2}
    return RunReport.model_validate({
        "id": run_id, "spec": {"tasks": "starter-python-functions", "base": "Qwen2.5-Coder-32B-Instruct-AWQ"},
        "state": state, "submitted": "2026-12-01T03:00:00Z", "started": None, "finished": None, "attempts": 1,
        "worker_pid": None, "message": None, "progress": progress}).model_dump(mode="json")


def taskset(name: str) -> dict[str, Any]:
    return {"name": name, "sha256": HASH, "source": "/srv/tasks/starter-python.jsonl", "tasks": 20, "train": 16,
            "held_out": 4, "created": "2026-12-01T03:00:00+00:00"}


def user(name: str, enabled: bool = True, roles: tuple[str, ...] = ("user",)) -> dict[str, Any]:
    return {"username": name, "enabled": enabled, "roles": list(roles)}


def audit_record(seq: int, **fields: Any) -> dict[str, Any]:
    return {"seq": seq, "time": f"2026-12-01T03:00:{seq % 60:02d}.000000Z", "request_id": f"req-{seq}",
            "action": "chat.completions", "outcome": "allowed", "status": 200, "username": "alice",
            "resource": "/v1/chat/completions", "prompt_tokens": 0, "completion_tokens": 0, "prev_hash": HASH,
            "hash": HASH, **fields}


def sample_answers() -> dict[str, Any]:
    """A busy appliance: rows in every table, in every state an action depends on."""
    return {
        **EMPTY_ANSWERS,
        "/services": [service("finetune-worker", "STOPPED"), service("gateway", "RUNNING"),
                      service("keycloak", "RUNNING"), service("rl-worker", "FATAL"), service("vllm-main", "RUNNING")],
        "/alerts": [alert("Watchdog", "none"), alert("DiskNearFull", "page", volume="state")],
        "/charts": chart_series(requests=[None, 0.5, 2.0, 1.25], server_errors=[None, 0.0, 0.25, 0.125],
                                latency_p50=[None, 0.02, 0.3, 1.5], kv_cache=[0.1, 0.2, 0.4, None]),
        "/pools": [{"name": "main", "model": "SmolLM2-135M-Instruct", "tier": None,
                    "replicas": [replica("main"), replica("main-1")]}],
        "/batches": {"object": "list", "data": [batch("batch_" + "a" * 24, "in_progress"),
                                                batch("batch_" + "b" * 24, "completed"),
                                                batch("batch_" + "c" * 24, "failed")]},
        "/jobs": [job(1, "succeeded"), job(2, "failed"), job(3, "running")],
        "/adapters": {"adapters": [adapter("support-bot", 1, "deployed"), adapter("support-bot", 2, "canary"),
                                   adapter("support-bot", 3, "registered"), adapter("support-bot", 4, "failed-gate"),
                                   adapter("fresh", 1, "registered")],
                      "aliases": {"support-bot": {"pool": "main", "roles": ["user"], "stable": 1, "canary": 2,
                                                  "canary_share": 0.1}}},
        "/rl/tasksets": [taskset("starter")],
        "/rl/runs": [rl_run(1, "succeeded"), rl_run(2, "running")],
        "/users": [user("admin", roles=("admin",)), user("frank", enabled=False),
                   user("root", roles=("user", "trainer", "auditor", "admin"))],
        "/keys": [api_key("ci-bot", "active"), api_key("old-bot", "revoked"), api_key("tmp-bot", "expired")],
        "/audit": [audit_record(seq) for seq in (12, 11, 10)],
        "/datasets": [{"name": name, "sha256": digest} for name, digest in DATASETS.items()],
        **{f"/datasets/{name}": dataset(name, digest) for name, digest in DATASETS.items()},
    }


DATASETS = {"faq": HASH, "support-faq": "0e" * 32}  # 11 characters: a name and its digest fit 80 columns


def dataset(name: str, digest: str) -> dict[str, Any]:
    """/datasets/NAME: the version in use and an older one."""
    version = {"sha256": digest, "current": True, "created": "2026-12-02T10:00:00+00:00", "source": f"{name}.jsonl",
               "kind": "SFT rows", "rows": 120, "train": 108, "eval": 12, "sensitive": {"email": 2},
               "sensitive_action": "redact"}
    older = {**version, "sha256": "3c" * 32, "current": False, "created": "2026-11-30T09:00:00+00:00", "rows": 90}
    return {"name": name, "versions": [version, older]}


def api_key(name: str, state: str) -> dict[str, Any]:
    return {"name": name, "owner": "alice", "prefix": "apk-AbCdEf", "state": state,
            "created": "2026-12-01T10:00:00Z", "created_by": "admin", "expires": None,
            "last_used": "2026-12-02T09:30:00Z" if state == "active" else None, "models": None,
            "tokens_per_minute": None}


class Fake:
    """The admin API as the screens call it: an answer per path (changed by a test between two
    refreshes), every call recorded with its query."""

    base_url = "http://127.0.0.1:9"

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers = answers
        self.calls: list[tuple[str, str, Any]] = []

    async def username(self) -> str:
        return "admin"

    async def call(self, method: str, path: str, **kwargs: Any) -> Any:
        self.calls.append((method, path, kwargs.get("params")))
        if method == "POST":
            return {"ok": True, "records": 1, "checkpoints": 0, "last_checkpoint_seq": 0}
        if isinstance(self.answers[path], Exception):
            raise self.answers[path]
        return self.answers[path]

    async def metrics_text(self) -> str:
        return ""

    async def close(self) -> None:
        pass

    def asked(self, path: str) -> list[Any]:
        """The queries of the reads of `path`, in order."""
        return [params for method, path_, params in self.calls if method == "GET" and path_ == path]

    def posted(self) -> list[str]:
        return [path for method, path, _ in self.calls if method == "POST"]


SCREENS = {"d": "Dashboard", "m": "Models", "j": "Training", "D": "Datasets", "e": "RlRuns", "u": "Users",
           "k": "Keys", "a": "AuditLog"}


def with_fake(home: Home, answers: dict[str, Any], scenario: Callable[[Pilot[None], AdminApp, Fake], Awaitable[None]],
              size: tuple[int, int] = (80, 24)) -> None:
    """Run `scenario` against the app at `size` with a Fake client answering `answers`."""
    from tui.app import AdminApp

    app = AdminApp(Settings(), home)
    fake = Fake(answers)
    app.client = fake  # type: ignore[assignment]

    async def run() -> None:
        async with app.run_test(size=size) as pilot:
            await scenario(pilot, app, fake)

    asyncio.run(run())


async def show(pilot: Pilot[None], key: str) -> None:
    """Switch to a screen by its key and let it load."""
    await pilot.press(key)
    await pilot.pause(0.3)
    assert type(pilot.app.screen).__name__ in (SCREENS[key], "Detail")


async def refreshed(pilot: Pilot[None]) -> None:
    """Reload the current screen now, as its timer does, and let the answer show."""
    screen = pilot.app.screen
    assert isinstance(screen, Panel)
    screen.reload()
    await pilot.pause(0.3)


def screen_lines(app: App[Any]) -> list[str]:
    """What the terminal shows, line by line."""
    console = Console(width=app.size.width, height=app.size.height, file=io.StringIO(), record=True,
                      legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text().splitlines()


def tables(app: App[Any]) -> list[DataTable[Any]]:
    return [t for t in app.screen.query(DataTable) if t.display]


def header_line(app: App[Any], table: DataTable[Any]) -> str:
    return screen_lines(app)[table.region.y]


async def select(pilot: Pilot[None], table_id: str, key: str) -> None:
    table = pilot.app.screen.query_one(f"#{table_id}", DataTable)
    table.focus()
    table.move_cursor(row=table.get_row_index(key))
    await pilot.pause()


def cursor_key(app: App[Any], table_id: str) -> str | None:
    return selected_key(app.screen.query_one(f"#{table_id}", DataTable))


def shown_text(app: App[Any], widget_id: str) -> str:
    return str(app.screen.query_one(f"#{widget_id}", Static).render())


def test_every_screen_fits_80x24_with_its_titles_and_column_headers_whole(home: Home) -> None:
    """Long names (a 30-character model, a 24-character task set) do not push a column off the
    screen; each title (with the keys of the selected row) is whole on its line."""

    async def scenario(pilot: Pilot[None], app: AdminApp, fake: Fake) -> None:
        for key in SCREENS:
            await show(pilot, key)
            lines = screen_lines(app)
            assert len(lines) == 24 and all(len(line) <= 80 for line in lines)
            for table in tables(app):
                header = header_line(app, table)
                labels = [str(column.label) for column in table.columns.values()]
                assert re.search(r"\s+".join(map(re.escape, labels)), header), (key, labels, header)
                assert table.virtual_size.width <= table.scrollable_content_region.width, (key, table.id, "scrolls")
            for label in app.screen.query(Label):
                title = str(label.render())
                assert any(title in line for line in lines), (key, title)
            assert lines[-1].startswith("d Dashboard") and "q Quit" in lines[-1], "the footer: the screens"

    with_fake(home, sample_answers(), scenario)


# (screen key, table, the row selected) -> the answers changed: rows added before it, the order changed
REORDERED: dict[tuple[str, str, str], Callable[[dict[str, Any]], dict[str, Any]]] = {
    ("d", "services", "keycloak"): lambda a: {"/services": [service("aaa-new", "RUNNING"), *reversed(a["/services"])]},
    ("m", "pools", "main-1"): lambda a: {"/pools": [{**a["/pools"][0], "replicas": [
        replica("main-2"), replica("main"), replica("main-1")]}]},
    ("m", "batches", "batch_" + "b" * 24): lambda a: {"/batches": {"object": "list", "data": [
        batch("batch_" + "d" * 24, "validating"), *reversed(a["/batches"]["data"])]}},
    ("j", "jobs", "2"): lambda a: {"/jobs": [*a["/jobs"], job(4, "queued"), job(5, "queued")]},
    ("j", "adapters", "support-bot:2"): lambda a: {"/adapters": {**a["/adapters"], "adapters": [
        adapter("another", 1, "registered"), *a["/adapters"]["adapters"]]}},
    ("e", "runs", "1"): lambda a: {"/rl/runs": [*a["/rl/runs"], rl_run(3, "queued")]},
    ("e", "tasksets", "starter"): lambda a: {"/rl/tasksets": [taskset("aardvark"), *a["/rl/tasksets"]]},
    ("u", "users", "frank"): lambda a: {"/users": [user("bob"), user("carol"), *reversed(a["/users"])]},
    ("k", "keys", "alice/old-bot"): lambda a: {"/keys": [api_key("aa-bot", "active"), *reversed(a["/keys"])]},
    ("a", "records", "11"): lambda a: {"/audit": [audit_record(14), audit_record(13), *a["/audit"]]},
    ("D", "datasets", "faq"): lambda a: {"/datasets": [{"name": "aaa", "sha256": HASH}, *reversed(a["/datasets"])]},
}


@pytest.mark.parametrize(("key", "table", "selected"), list(REORDERED), ids=[t for _, t, _ in REORDERED])
def test_the_selection_stays_on_its_record_when_a_refresh_adds_and_reorders_rows(
        home: Home, key: str, table: str, selected: str) -> None:
    answers = sample_answers()

    async def scenario(pilot: Pilot[None], app: AdminApp, fake: Fake) -> None:
        await show(pilot, key)
        await select(pilot, table, selected)
        before = app.screen.query_one(f"#{table}", DataTable).cursor_row
        answers.update(REORDERED[key, table, selected](answers))
        await refreshed(pilot)
        assert cursor_key(app, table) == selected
        assert app.screen.query_one(f"#{table}", DataTable).cursor_row != before, "the rows did move"

    with_fake(home, answers, scenario)


def test_the_selected_record_stays_where_it_is_on_the_screen_when_records_arrive_above_it(home: Home) -> None:
    """A long table scrolled to the middle: the refresh neither jumps the view to the top nor
    slides the selected record away; the new records scroll in above it."""
    answers = {**sample_answers(), "/audit": [audit_record(seq) for seq in range(100, 40, -1)]}

    async def scenario(pilot: Pilot[None], app: AdminApp, fake: Fake) -> None:
        await show(pilot, "a")
        table = app.screen.query_one("#records", DataTable)
        await select(pilot, "records", "70")
        table.scroll_to(y=table.cursor_row - 5, animate=False)
        await pilot.pause(0.2)
        assert (table.cursor_row, table.scroll_y) == (30, 25)
        answers["/audit"] = [audit_record(102), audit_record(101), *answers["/audit"]]
        await refreshed(pilot)
        assert cursor_key(app, "records") == "70"
        assert (table.cursor_row, table.scroll_y) == (32, 27), "five rows below the top of the view, as before"

    with_fake(home, answers, scenario)


def test_a_refresh_sends_the_query_of_the_view_it_refreshes_and_a_new_filter_a_new_one(home: Home) -> None:
    """The gateway tells a refresh (not recorded again) from a new query (recorded) by the query:
    polling resends it unchanged, even while a filter is being typed; submitting sends a new one."""
    async def scenario(pilot: Pilot[None], app: AdminApp, fake: Fake) -> None:
        await show(pilot, "a")
        await refreshed(pilot)
        first = fake.asked("/audit")[0]
        assert first == {"newest": True, "limit": 200}
        app.screen.query_one("#user", Input).value = "ali"  # typed, not submitted yet
        await refreshed(pilot)
        await refreshed(pilot)
        assert all(query == first for query in fake.asked("/audit"))
        app.screen.query_one("#user", Input).value = "alice"
        app.screen.query_one("#user", Input).focus()
        await pilot.press("enter")
        await pilot.pause(0.3)
        assert fake.asked("/audit")[-1] == {**first, "user": "alice"}
        app.screen.query_one("#outcome", Select).value = "invalid"
        await pilot.pause(0.3)
        applied = {**first, "user": "alice", "outcome": "invalid"}
        assert fake.asked("/audit")[-1] == applied
        await refreshed(pilot)
        assert fake.asked("/audit")[-1] == applied
        await show(pilot, "u")
        await refreshed(pilot)
        assert set(map(str, fake.asked("/users"))) == {"None"}, "the users list takes no query"

    with_fake(home, sample_answers(), scenario)


def cli_problem(invocation: str) -> str | None:
    """Why `appliance ...` (words, options; UPPER-CASE placeholders) is not a current command, or None."""
    import typer

    from appliance import cli

    command = typer.main.get_command(cli.app)
    context = typer.Context(command, info_name="appliance", resilient_parsing=True)
    for word in invocation.split()[1:]:
        if word.startswith("-"):
            if word not in {name for param in command.params for name in param.opts}:
                return f"{invocation}: no option {word}"
        elif not word.isupper():
            found = command.resolve_command(context, [word])[1] if hasattr(command, "resolve_command") else None
            if found is None or found.hidden:  # hidden: an old spelling, kept for a release
                return f"{invocation}: no command {word!r}"
            command, context = found, typer.Context(found, info_name=word, parent=context, resilient_parsing=True)
    return None


def test_every_empty_table_says_what_would_be_there_and_how_to_get_it(home: Home) -> None:
    """A fresh install: each table is empty and says so, with a command that exists."""
    found: dict[str, str] = {}

    async def scenario(pilot: Pilot[None], app: AdminApp, fake: Fake) -> None:
        for key in SCREENS:
            await show(pilot, key)
            for table in app.screen.query(DataTable):
                if table.id == "gpus":
                    continue  # hidden without GPUs: the host line says there are none
                note = app.screen.query_one(f"#{table.id}-empty", Static)
                assert table.row_count == 0 and note.display and note.has_class("shown"), table.id
                found[str(table.id)] = shown_text(app, f"{table.id}-empty")
                assert any(found[str(table.id)][:30] in line for line in screen_lines(app)), table.id
        app.screen.query_one("#action", Input).value = "users.add"
        app.screen.query_one("#action", Input).focus()
        await pilot.press("enter")
        await pilot.pause(0.3)
        assert "No records match these filters" in shown_text(app, "records-empty")

    with_fake(home, dict(EMPTY_ANSWERS), scenario)
    assert set(found) == {"services", "pools", "batches", "jobs", "adapters", "tasksets", "runs", "attempts",
                          "users", "keys", "records", "datasets"}
    assert "`appliance finetune submit" in found["adapters"]
    commands = [quoted for text in found.values() for quoted in re.findall(r"`(appliance [^`]+)`", text)]
    assert len(commands) >= 8
    assert [problem for command in commands if (problem := cli_problem(command))] == []


def test_actions_that_cannot_apply_to_the_selected_row_are_not_offered(home: Home) -> None:
    """Neither shown (footer or the table's title) nor taken: the key does nothing, no dialog."""

    async def pressed(pilot: Pilot[None], key: str) -> str:
        """Press `key`; the dialog it opened (closed again), if any."""
        await pilot.press(key)
        await pilot.pause(0.2)
        opened = type(pilot.app.screen).__name__
        if opened in ("Confirm", "Form"):
            await pilot.press("escape")
            await pilot.pause(0.1)
        return opened

    async def scenario(pilot: Pilot[None], app: AdminApp, fake: Fake) -> None:
        await show(pilot, "d")
        await select(pilot, "services", "gateway")
        assert shown_text(app, "services-title") == "Services: 5 (the gateway stops with `appliance down`)"
        assert [await pressed(pilot, k) for k in "str"] == ["Dashboard"] * 3
        await select(pilot, "services", "finetune-worker")  # STOPPED
        assert shown_text(app, "services-title") == "Services: 5 (s: start)"
        await select(pilot, "services", "vllm-main")
        assert shown_text(app, "services-title") == "Services: 5 (t: stop, r: restart)"
        assert await pressed(pilot, "t") == "Confirm"

        await show(pilot, "m")
        for key, offered in (("batch_" + "b" * 24, False), ("batch_" + "c" * 24, False), ("batch_" + "a" * 24, True)):
            await select(pilot, "batches", key)
            assert ("c: cancel" in shown_text(app, "batches-title")) is offered
            assert (await pressed(pilot, "c") == "Confirm") is offered

        await show(pilot, "j")
        for key, offered in (("1", False), ("2", False), ("3", True)):
            await select(pilot, "jobs", key)
            assert ("c: cancel" in shown_text(app, "jobs-title")) is offered
            assert (await pressed(pilot, "c") == "Confirm") is offered
        expected = {"support-bot:1": "", "support-bot:2": "p: deploy, b: rollback",  # v1 stable, v2 its canary
                    "support-bot:3": "p: deploy, n: canary, r: retire", "support-bot:4": "r: retire",
                    "fresh:1": "p: deploy, r: retire"}
        for key, keys in expected.items():
            await select(pilot, "adapters", key)
            assert shown_text(app, "adapters-title") == (f"Adapters ({keys})" if keys else "Adapters"), key
        await select(pilot, "adapters", "support-bot:4")  # failed its gate: only retiring applies
        assert [await pressed(pilot, k) for k in "pnb"] == ["Training"] * 3
        await select(pilot, "adapters", "support-bot:1")  # served: not retired
        assert await pressed(pilot, "r") == "Training"

        await show(pilot, "e")
        await select(pilot, "runs", "1")
        assert shown_text(app, "runs-title") == "RL runs (t: trajectories, x: export SFT and DPO sets)"
        assert await pressed(pilot, "c") == "RlRuns"
        await select(pilot, "runs", "2")
        assert shown_text(app, "runs-title") == "RL runs (c: cancel)"
        assert [await pressed(pilot, k) for k in "tx"] == ["RlRuns"] * 2
        assert "sandbox queue 3, 4 workers" in shown_text(app, "run")

        await show(pilot, "u")
        await select(pilot, "users", "frank")  # disabled already
        assert shown_text(app, "users-title") == ("Users (n: add, E: enable, g: grant, r: revoke, p: new password, "
                                                  "l: unlock)")
        assert await pressed(pilot, "x") == "Users"
        await select(pilot, "users", "root")  # holds every role
        assert shown_text(app, "users-title") == "Users (n: add, x: disable, r: revoke, p: new password, l: unlock)"
        assert [await pressed(pilot, k) for k in "gE"] == ["Users"] * 2
        await select(pilot, "users", "admin")
        await pilot.press("g")
        await pilot.pause(0.2)
        choices = [str(option[0]) for option in app.screen.query_one("#field-role", Select)._options]
        assert "admin" not in choices and "user" in choices, "only roles not held yet"
        await pilot.press("escape")
        await pilot.pause(0.1)

        await show(pilot, "k")
        for key, offered in (("old-bot", False), ("tmp-bot", False), ("ci-bot", True)):
            await select(pilot, "keys", f"alice/{key}")  # rows by owner and name: a name is its owner's
            assert ("x: revoke" in shown_text(app, "keys-title")) is offered
            assert (await pressed(pilot, "x") == "Confirm") is offered
        await pilot.press("escape")
        assert fake.posted() == [], "nothing was asked of the appliance"

    with_fake(home, sample_answers(), scenario)


def test_a_cpu_host_says_plainly_it_has_no_gpu(home: Home) -> None:
    answers = sample_answers()

    async def scenario(pilot: Pilot[None], app: AdminApp, fake: Fake) -> None:
        await show(pilot, "d")
        line = shown_text(app, "host")
        assert "This host has no GPU: the CPU engine serves the models." in line
        assert "NVML" not in line and "Not Found" not in line
        answers["/system"] = host("NVML query failed: Unknown Error")  # a GPU host whose driver fails
        await refreshed(pilot)
        assert "GPU figures unavailable: NVML query failed: Unknown Error" in shown_text(app, "host")

    with_fake(home, answers, scenario)


def test_the_dashboard_shows_the_alerts_that_need_someone(home: Home) -> None:
    answers = sample_answers()

    async def scenario(pilot: Pilot[None], app: AdminApp, fake: Fake) -> None:
        await show(pilot, "d")
        assert shown_text(app, "alerts") == "Alerts: 1 firing: DiskNearFull (page); heartbeat ok", "not counted"
        answers["/alerts"] = [alert("Watchdog", "none")]
        await refreshed(pilot)
        assert shown_text(app, "alerts") == "Alerts: none firing; heartbeat ok"
        answers["/alerts"] = Refused(409, "monitoring is off (monitoring.enabled = false)", "GET /admin/alerts")
        await refreshed(pilot)
        assert shown_text(app, "alerts").startswith("Alerts: unknown (") and "monitoring is off" in shown_text(
            app, "alerts")
        assert "This host has no GPU" in shown_text(app, "host"), "the rest of the screen goes on"

    with_fake(home, answers, scenario)


def chart_rows(app: AdminApp) -> dict[str, tuple[str, list[float], str]]:
    """The charts shown: label, the sparkline's points and the latest value, by series."""
    from textual.widgets import Sparkline

    area = app.screen.query_one("#charts")
    return {str(row.id).removeprefix("chart-"): (str(row.query_one(".chart-label", Static).render()),
                                                 list(row.query_one(Sparkline).data or []),
                                                 str(row.query_one(".chart-value", Static).render()))
            for row in area.children} if area.display else {}


def test_the_dashboard_charts_the_key_series_from_prometheus_or_says_why_not(home: Home) -> None:
    answers = sample_answers()

    async def scenario(pilot: Pilot[None], app: AdminApp, fake: Fake) -> None:
        await show(pilot, "d")
        assert fake.asked("/charts"), "read through the admin API"
        assert shown_text(app, "charts-state") == "Charts: the last 15 min, from Prometheus"
        rows = chart_rows(app)
        assert list(rows) == [chart.name for chart in charts.CHARTS], "a row a series, in order"
        assert rows["requests"] == ("requests/s", [0.5, 2.0, 1.25], "1.2 req/s"), "a gap is no sample, not a zero"
        assert rows["server_errors"][2] == "12.5%"
        assert rows["latency_p50"][2] == "1.50 s"
        assert rows["kv_cache"][1:] == ([0.1, 0.2, 0.4], "-"), "no sample now: no value made up"
        assert rows["engine_waiting"] == ("engine waiting", [], "no data")
        answers["/charts"] = chart_series(requests=[0.5, 2.0, 1.25, 3.0], latency_p50=[None, None, None, 0.02])
        await refreshed(pilot)
        assert chart_rows(app)["requests"][1:] == ([0.5, 2.0, 1.25, 3.0], "3.0 req/s")
        assert chart_rows(app)["latency_p50"][2] == "20 ms"
        for refused in (Refused(409, "monitoring is off (monitoring.enabled = false)", "GET /admin/charts"),
                        Refused(503, "Prometheus at https://127.0.0.1:9090 did not answer", "GET /admin/charts")):
            answers["/charts"] = refused
            await refreshed(pilot)
            state = shown_text(app, "charts-state")
            assert state.startswith("Charts: unknown (") and refused.reason in state
            assert chart_rows(app) == {}, "no old line left standing for now"
            assert "This host has no GPU" in shown_text(app, "host"), "the rest of the screen goes on"
        answers["/charts"] = chart_series(requests=[1.0, None, None, 2.0])
        await refreshed(pilot)
        assert chart_rows(app)["requests"][1:] == ([1.0, 2.0], "2.0 req/s")

    with_fake(home, answers, scenario, size=(100, 50))


def test_a_chart_s_value_is_shown_in_its_unit() -> None:
    from tui.dashboard import value_text

    assert [value_text(v, "ratio") for v in (0.0, 0.0312, 1.0)] == ["0.0%", "3.1%", "100.0%"]
    assert [value_text(v, "s") for v in (0.0004, 0.25, 2.5)] == ["0 ms", "250 ms", "2.50 s"]
    assert [value_text(v, "req/s") for v in (0.25, 1234.4)] == ["0.2 req/s", "1234 req/s"]
    assert value_text(250.0, "tok/s") == "250 tok/s" and value_text(3.0, "requests") == "3"


NEW_RECORD = audit_record(
    42, action="adapters.deploy", outcome="denied", status=403, reason="role_missing", key="ci-bot",
    model="support-bot", username="frank", subject="7c9e6679-7425-40de-944b-e07fc1f90ae7", source="10.0.0.7",
    target={"kind": "adapter", "name": "support-bot", "version": 3, "roles": ["user", "trainer"]},
    sensitive={"prompt.email": "flagged", "answer.payment_card": "redacted"}, prompt_hmac="ab" * 32,
    latency_ms=12.4, prompt_tokens=7, completion_tokens=0, tier=None, error=None, future_field="kept")
OLD_RECORD = {key: value for key, value in audit_record(7).items()}


def rendered(view: Any, width: int) -> list[str]:
    console = Console(width=width, file=io.StringIO(), record=True)
    console.print(view)
    return [line.rstrip() for line in console.export_text().splitlines()]


def test_a_record_s_detail_is_laid_out_by_field_with_hashes_whole() -> None:
    from tui.audit_log import record_view

    lines = rendered(record_view(NEW_RECORD), 66)
    text = "\n".join(lines)
    expected = [r"time\s+2026-12-01 03:00:42\.000000 UTC", r"action\s+adapters\.deploy", r"outcome\s+denied",
                r"reason\s+role_missing", r"HTTP status\s+403", r"user\s+frank", r"API key\s+ci-bot",
                r"model\s+support-bot", r"target\s+adapter support-bot v3", r"^\s+roles: user, trainer",
                r"sensitive data\s+prompt\.email: flagged", r"^\s+answer\.payment_card: redacted",
                r"tokens\s+7 in, 0 out", r"latency\s+12 ms", r"future_field\s+kept"]
    for pattern in expected:
        assert re.search(pattern, text, re.M), pattern
    for label, value in (("prompt HMAC", "ab" * 32), ("previous record's hash", HASH), ("this record's hash", HASH)):
        assert lines[lines.index(label) + 1] == f"  {value}", "on a line of its own, unbroken"
    assert "{" not in text and '"' not in text, "no JSON"
    assert not re.search(r"^(tier|error)\b", text, re.M), "empty fields are left out"

    old = "\n".join(rendered(record_view(OLD_RECORD), 66))
    assert re.search(r"outcome\s+allowed", old) and re.search(r"resource\s+/v1/chat/completions", old)
    assert not re.search(r"^(reason|target|API key|model|tokens)\b", old, re.M), "an old record shows what it has"


def test_the_audit_screen_shows_a_record_s_detail_whole_at_80x24(home: Home) -> None:
    answers = {**sample_answers(), "/audit": [NEW_RECORD, OLD_RECORD]}

    async def scenario(pilot: Pilot[None], app: AdminApp, fake: Fake) -> None:
        await show(pilot, "a")
        await pilot.press("enter")
        await pilot.pause(0.3)
        assert type(app.screen).__name__ == "Detail"
        assert any(re.search(r"target\s+adapter support-bot v3", line) for line in screen_lines(app))
        app.screen.query_one(VerticalScroll).scroll_end(animate=False)
        await pilot.pause(0.2)
        assert any(f"  {HASH}" in line for line in screen_lines(app)), "the hash whole on an 80-column screen"

    with_fake(home, answers, scenario)


def test_the_rollback_question_says_what_the_name_serves_after() -> None:
    """Past a name's first version it serves nothing (refused), never the base model."""
    served = Alias(pool="main", roles=[Role.USER], stable=2, history=[1])
    assert rollback_question("codes", served) == "Roll back 'codes' from v2 to v1?"
    first = Alias(pool="main", roles=[Role.USER], stable=1)
    assert rollback_question("codes", first) == ("Roll back 'codes' from v1 to no version (its requests refused "
                                                 "until a deploy)?")
    canary = Alias(pool="main", roles=[Role.USER], stable=1, canary=2, canary_share=0.5)
    assert rollback_question("codes", canary) == "Roll back 'codes': drop its canary v2?"
