"""The administrator's terminal UI, driven by Textual's pilot against the session
appliance (real gateway, supervisord, Keycloak, vLLM): every screen and every action, the banner
for a stopped gateway and an expired login, the device-code login, and a run in a real terminal
(tmux, 80x24)."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from rich.console import Console
from textual.pilot import Pilot
from textual.widgets import Input, Select, Static

from appliance import adapters, jobs, login
from appliance import connection as connections
from appliance.adapters import AdapterState
from appliance.artifacts import artifact_store
from appliance.home import Home
from appliance.jobs import Hyperparameters
from appliance.records import config_sha256
from appliance.secrets import secret
from appliance.settings import load_settings
from appliance.supervisor import Supervisor
from finetune.adapters import register
from installer.realm import BOOTSTRAP_SECRET
from tests.integration.conftest import Running
from tests.integration.realm import Realm
from tests.support import waiting
from tests.support.appliances import APPLIANCE
from tests.support.browser import approve_device_login
from tests.support.models import random_adapter
from tests.support.pilot import drive, rows, select_row, text, until
from tests.support.records import metrics
from tests.support.terminal import Pane, broken
from tui.app import AdminApp

# Its dashboard stops and starts the session's programs.
pytestmark = pytest.mark.session_exclusive

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def realm(running: Running) -> Realm:
    return Realm(running)


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where each screen's SVG screenshot goes: docs/screenshots/ when refreshing the README's
    (APPLIANCE_TUI_SCREENSHOTS=docs/screenshots .venv/bin/pytest tests/integration/test_admin_tui.py)."""
    chosen = os.environ.get("APPLIANCE_TUI_SCREENSHOTS")
    if not chosen:
        return tmp_path_factory.mktemp("screenshots")
    Path(chosen).mkdir(parents=True, exist_ok=True)
    return Path(chosen).absolute()


@pytest.fixture
def app(running: Running) -> AdminApp:
    """The app with a fresh admin login in the cache, as `appliance token` leaves it."""
    cli = running.appliance
    settings = load_settings(cli.home.settings_file, environ=cli.env)
    login.password_login(connections.local(settings, cli.home), "admin", secret(cli.home, BOOTSTRAP_SECRET))
    return AdminApp(settings, cli.home)


def banner(app: AdminApp) -> str | None:
    """The current screen's problem banner; a dialog over it counts as one."""
    found = app.screen.query("#banner")
    if not found:
        return f"(dialog {type(app.screen).__name__} open)"
    return str(found.first(Static).render()) if found.first().has_class("shown") else None


def detail_lines(app: AdminApp) -> list[str]:
    """The open detail dialog's text, laid out as on a terminal wide enough for every value."""
    console = Console(width=200, file=io.StringIO(), record=True)
    console.print(app.screen.query_one("#detail-body", Static).content)
    return [line.rstrip() for line in console.export_text().splitlines()]


def test_dashboard_shows_services_host_and_traffic_and_controls_services(app: AdminApp, realm: Realm,
                                                                        shots: Path) -> None:
    token = realm.admin_token()

    async def scenario(pilot: Pilot) -> None:
        await until(pilot, lambda: rows(app, "services").get("gateway", [""])[1:2] == ["RUNNING"], "services")
        assert {"keycloak", "vllm-main", "gateway", "finetune-worker"} <= set(rows(app, "services"))
        assert "CPU" in text(app, "host") and "RAM" in text(app, "host")
        # The session reads its GPUs through the stand-in NVML library (tests/support/fake_nvml.c).
        gpus = rows(app, "gpus")
        assert [cells[1:3] for cells in gpus.values()] == [["Fake H200", "87%"], ["Fake H200", "3%"]], gpus
        for _ in range(3):  # traffic between two scrapes shows up as a rate and on the chart
            reply = await asyncio.to_thread(
                httpx.post, f"{realm.gateway}/v1/chat/completions", headers={"Authorization": f"Bearer {token}"},
                json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}, timeout=120)
            assert reply.status_code == 200
        await until(pilot, lambda: re.search(r"/v1: [1-9]|/v1: 0\.[1-9]", text(app, "traffic")) is not None,
                    "a request rate")
        assert re.search(r"p50 \d+ ms", text(app, "traffic"))

        restarts = int(rows(app, "services")["finetune-worker"][4])
        await select_row(pilot, "services", "finetune-worker")
        await pilot.press("t")
        await pilot.press("y")  # the confirmation dialog
        await until(pilot, lambda: rows(app, "services")["finetune-worker"][1] == "STOPPED", "the worker stopped")
        await pilot.press("s")
        await until(pilot, lambda: rows(app, "services")["finetune-worker"][1] == "RUNNING", "the worker started")
        await pilot.press("r")
        await pilot.press("n")  # declined: nothing happens
        await pilot.press("r")
        await pilot.press("y")
        await until(pilot, lambda: int(rows(app, "services")["finetune-worker"][4]) == restarts + 2,
                    "two more starts counted")
        await select_row(pilot, "services", "gateway")  # it cannot stop itself: nothing is offered
        assert re.fullmatch(r"Services: \d+ \(the gateway stops with `appliance down`\)", text(app, "services-title"))
        await pilot.press("r")
        await pilot.pause(1)
        assert type(pilot.app.screen).__name__ == "Dashboard", "no confirmation: restart is not offered"
        app.save_screenshot("dashboard.svg", path=str(shots))

    drive(app, scenario)


def test_models_screen_shows_pool_plan_and_staging(app: AdminApp, shots: Path) -> None:
    async def scenario(pilot: Pilot) -> None:
        await pilot.press("m")
        await until(pilot, lambda: "main" in rows(app, "pools") and "Layout" in text(app, "plan-text"), "the plan")
        assert rows(app, "pools")["main"][1:4] == [MODEL, "-", "healthy"]  # no GPUs on the CPU engine
        plan = text(app, "plan-text")
        assert "Layout: TP1 PP1 DP1 EP off over 1 GPUs on 1 host(s)" in plan
        assert re.search(r"Per GPU: weights [\d.]+ GiB \+ KV cache [\d.]+ GiB", plan)
        assert re.search(r"Staged \(subset, host node-0\): \d+ files, [\d.]+ GiB, complete", plan)
        app.save_screenshot("models.svg", path=str(shots))

    drive(app, scenario)


def test_jobs_and_adapters_screen_cancels_deploys_canaries_and_rolls_back(
        app: AdminApp, running: Running, demo_model: Path, tmp_path: Path, shots: Path) -> None:
    home: Home = running.appliance.home
    adapter = random_adapter(demo_model, tmp_path / "adapter")
    store = artifact_store(app.settings.artifacts, home)
    identity = config_sha256(json.loads((demo_model / "config.json").read_text()))
    for version_loss in (0.9, 0.8):
        register(home, store, adapter, name="tui-adapter", base_model=MODEL, base_config_sha256=identity,
                 dataset="none", dataset_sha256="-", hyperparameters=Hyperparameters(),
                 state=AdapterState.REGISTERED, metrics=metrics(adapter_eval_loss=version_loss, eval_sets={
                     "scenario": {"base": 0.25, "adapter": 0.75}}))

    async def scenario(pilot: Pilot) -> None:
        await pilot.press("j")
        key = str(job.id)
        await until(pilot, lambda: key in rows(app, "jobs"), "the job")
        assert rows(app, "jobs")[key][1:7] == ["tui-job", "queued", "step 3/10", "1.250", "321", "-"]
        await select_row(pilot, "jobs", key)
        await pilot.press("c")
        await pilot.press("y")
        await until(pilot, lambda: rows(app, "jobs")[key][2] == "cancelled", "the job cancelled")

        await until(pilot, lambda: "tui-adapter:2" in rows(app, "adapters"), "the adapters")
        assert rows(app, "adapters")["tui-adapter:1"][2:5] == ["registered", "",
                                                               "loss 1.500->0.900, scenario 25% -> 75%"]
        await select_row(pilot, "adapters", "tui-adapter:1")
        await pilot.press("p")
        await pilot.press("y")
        await until(pilot, lambda: rows(app, "adapters")["tui-adapter:1"][3] == "stable", "v1 deployed", 180)
        await select_row(pilot, "adapters", "tui-adapter:2")
        await pilot.press("n")
        share = pilot.app.screen.query_one("#field-share", Input)
        share.value = "0.5"
        await pilot.press("enter")
        await until(pilot, lambda: rows(app, "adapters")["tui-adapter:2"][3] == "canary 50%", "v2 in canary", 180)
        await pilot.press("b")
        await pilot.press("y")
        await until(pilot, lambda: rows(app, "adapters")["tui-adapter:2"][3] == "", "the canary dropped", 180)
        assert rows(app, "adapters")["tui-adapter:1"][3] == "stable"
        app.save_screenshot("jobs.svg", path=str(shots))

    # The trainer's progress report, as the worker's trainer writes it; the worker stays stopped
    # so that the job is still queued when the UI cancels it.
    supervisor = Supervisor(home)
    supervisor.call("stopProcess", "finetune-worker", True)
    try:
        job = jobs.submit(home, name="tui-job", data="none", base="demo", hyperparameters=Hyperparameters(),
                          eval_sets={})
        directory = jobs.job_dir(home, job.id)
        directory.mkdir(parents=True, exist_ok=True)
        jobs.write_progress(directory, jobs.Progress(step=3, max_steps=10, loss=1.25, tokens_per_s=321.0, eta_s=42))
        shown = drive(app, scenario)
    finally:
        supervisor.call("startProcess", "finetune-worker", True)
    assert any("deployed" in message for message in shown) and any("rolled back" in message for message in shown)
    assert jobs.get(home, job.id).state == "cancelled"
    alias = adapters.load(home).aliases["tui-adapter"]  # the UI changed the real registry
    assert (alias.stable, alias.canary) == (1, None)
    retired = httpx.post(f"{app.client.base_url}/admin/adapters/tui-adapter/retire", json={}, timeout=120,
                         headers={"Authorization": f"Bearer {login.current_token(app.client.connection).access_token}"})
    assert retired.status_code == 200, retired.text  # the other tests expect the base model alone


def test_users_screen_adds_grants_and_disables(app: AdminApp, realm: Realm, shots: Path) -> None:
    password: list[str] = []

    async def scenario(pilot: Pilot) -> None:
        await pilot.press("u")
        await until(pilot, lambda: "admin" in rows(app, "users"), "the users")
        await pilot.press("n")
        pilot.app.screen.query_one("#field-username", Input).value = "tui-frank"
        pilot.app.screen.query_one("#field-role", Select).value = "user"
        await pilot.click("#ok")
        await until(pilot, lambda: bool(pilot.app.screen.query("#detail-body")), "the generated password")
        password.append(str(pilot.app.screen.query_one("#detail-body", Static).render()).split(": ")[1].strip())
        await pilot.press("escape")
        await until(pilot, lambda: "tui-frank" in rows(app, "users"), "the new user")
        await select_row(pilot, "users", "tui-frank")
        await pilot.press("g")
        pilot.app.screen.query_one("#field-role", Select).value = "auditor"
        await pilot.click("#ok")
        await pilot.press("y")
        await until(pilot, lambda: rows(app, "users")["tui-frank"][2] == "auditor, user", "the granted role")
        await pilot.press("x")
        await pilot.press("y")
        await until(pilot, lambda: rows(app, "users")["tui-frank"][1] == "DISABLED", "the user disabled")
        app.save_screenshot("users.svg", path=str(shots))

    drive(app, scenario)
    with pytest.raises(httpx.HTTPStatusError) as refused:
        realm.token("tui-frank", password[0])
    assert "disabled" in refused.value.response.text.lower()  # the password was real; the user is disabled


def test_audit_screen_filters_shows_a_record_and_verifies_the_chain(app: AdminApp, shots: Path) -> None:
    async def scenario(pilot: Pilot) -> None:
        await pilot.press("a")
        await until(pilot, lambda: bool(rows(app, "records")), "records")
        await pilot.press("f")  # to the filters
        assert pilot.app.focused is pilot.app.screen.query_one("#user", Input)
        pilot.app.screen.query_one("#action", Input).value = "users.add"
        await pilot.press("enter")
        await until(pilot, lambda: bool(rows(app, "records")) and all(
            r[2] == "users.add" for r in rows(app, "records").values()), "only users.add records")
        pilot.app.screen.query_one("#outcome", Select).value = "denied"
        await until(pilot, lambda: not rows(app, "records"), "no denied users.add records")
        pilot.app.screen.query_one("#outcome", Select).value = "allowed"
        await until(pilot, lambda: bool(rows(app, "records")), "the allowed ones again")
        await pilot.press("enter")  # the selected record's detail
        await until(pilot, lambda: bool(pilot.app.screen.query("#detail-body")), "the record detail")
        detail = detail_lines(app)
        assert any(re.fullmatch(r"action\s+users\.add", line) for line in detail), detail
        for label in ("previous record's hash", "this record's hash"):  # each whole on a line of its own
            assert re.fullmatch(r"  [0-9a-f]{64}", detail[detail.index(label) + 1]), detail
        await pilot.press("escape")
        await pilot.press("v")
        await until(pilot, lambda: text(app, "chain").startswith("Chain verified"), "the chain verified")
        assert re.search(r"Chain verified: \d+ records, \d+ signed checkpoints", text(app, "chain"))
        app.save_screenshot("audit.svg", path=str(shots))

    drive(app, scenario)


def test_audit_records_holding_markup_are_shown_as_text(app: AdminApp, realm: Realm) -> None:
    """A record whose resource is Rich markup (`[/x]` crashed DataTable, `[link=...]`
    would have restyled it) made by a real request through the gateway, from a source of its own
    (so that it has its own record, not a refusal summary's)."""
    hostile = "/v1/[/x][link=https://example.invalid]click[/link]"
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.77")) as stranger:
        # Signed in: an anonymous request is refused on its headers, before any route is matched.
        headers = {"Authorization": f"Bearer {realm.admin_token()}"}
        assert stranger.get(f"{realm.gateway}{hostile}", headers=headers).status_code == 404

    async def scenario(pilot: Pilot) -> None:
        await pilot.press("a")
        action = pilot.app.screen.query_one("#action", Input)
        action.value = "unmatched"
        action.focus()
        await pilot.press("enter")  # the filter applies when submitted
        await until(pilot, lambda: any(hostile in str(r[5]) for r in rows(app, "records").values()),
                    "the hostile record, shown as written")
        await select_row(pilot, "records", next(k for k, r in rows(app, "records").items() if hostile in str(r[5])))
        await pilot.press("enter")
        await until(pilot, lambda: bool(pilot.app.screen.query("#detail-body")), "the record detail")
        assert any(hostile in line for line in detail_lines(app))
        await pilot.press("escape")

    drive(app, scenario)


def test_banner_for_a_stopped_gateway_and_an_expired_login_then_device_login(app: AdminApp, running: Running,
                                                                            realm: Realm) -> None:
    home = running.appliance.home
    supervisor = Supervisor(home)
    cache = app.client.connection.token_cache

    async def scenario(pilot: Pilot) -> None:
        await until(pilot, lambda: "gateway" in rows(app, "services"), "the dashboard")
        assert banner(app) is None
        supervisor.call("stopProcess", "gateway", True)
        try:
            await until(pilot, lambda: "does not answer" in (banner(app) or ""), "the stopped-gateway banner")
            assert "retrying" in (banner(app) or "")
        finally:
            supervisor.call("startProcess", "gateway", True)
        await until(pilot, lambda: banner(app) is None, "the banner gone after the gateway came back")

        # The TUI holds its own session (the cache is the CLI's): that session expires.
        held = app.session.token()
        app.session.adopt(dataclasses.replace(held, expires_at=time.time() - 60, refresh_expires_at=time.time() - 1))
        await until(pilot, lambda: "Not logged in" in (banner(app) or ""), "the expired-login banner")
        assert "the login as admin has expired; press L to log in again" in (banner(app) or "")
        await pilot.press("L")
        await until(pilot, lambda: "approve the code" in text(app, "login-text"), "the device code")
        url = re.search(r"Open (\S+)", text(app, "login-text")).group(1)
        page = await asyncio.to_thread(approve_device_login, url, "admin", secret(home, BOOTSTRAP_SECRET),
                                       realm.tls)
        assert "successful" in page.lower(), page[:300]
        await until(pilot, lambda: banner(app) is None and pilot.app.sub_title.startswith("admin @"),
                    "logged in again", 90)

    drive(app, scenario)
    assert json.loads(cache.read_text())["expires_at"] > time.time() + 60


def captured(session: str) -> str:
    """What the tmux pane shows now."""
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout


def shown(session: str, expect: object, what: str) -> str:
    """The pane, once it shows `expect` (a string in it, or a pattern found in it)."""
    def showing() -> str | None:
        pane = captured(session)
        found = expect.search(pane) if isinstance(expect, re.Pattern) else str(expect) in pane
        return pane if found else None

    return waiting.until(showing, lambda: f"{what}; the pane:\n{captured(session)}", 60, interval_s=0.3)


def ended(session: str) -> bool:
    """Whether the tmux session is gone."""
    return subprocess.run(["tmux", "has-session", "-t", session], capture_output=True).returncode != 0


RECORD_TIME = re.compile(r"\d\d-\d\d \d\d:\d\d:\d\d")  # the audit table's time column (MM-DD HH:MM:SS)


def test_every_screen_in_a_real_terminal(running: Running, app: AdminApp, tmp_path: Path) -> None:
    """Start `appliance tui` in tmux (80x24), go through every screen by its key, capture each."""
    assert shutil.which("tmux"), "tmux is needed for this test (bootstrap.sh installs it)"
    session = f"appliance-tui-{running.appliance.home.root.name}"
    environment = [arg for key, value in running.appliance.env.items() if key.startswith(("APPLIANCE_", "PATH"))
                   for arg in ("-e", f"{key}={value}")]
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "80", "-y", "24", *environment,
                    APPLIANCE, "tui"], check=True)
    captures: dict[str, str] = {}
    try:
        for key, expect in (("d", "restarts"), ("m", "Layout: TP1"), ("j", "Training jobs"), ("e", "RL runs"),
                            ("u", "enabled"), ("k", "API keys"), ("a", "Chain not verified")):
            subprocess.run(["tmux", "send-keys", "-t", session, key], check=True)
            pane = shown(session, expect, f"screen {key!r} to show {expect!r}")
            captures[key] = pane
            (tmp_path / f"pane-{key}.txt").write_text(pane)
            lines = pane.splitlines()
            assert len(lines) <= 24 and all(len(line) <= 80 for line in lines)
            assert all(f"{key} {name}" in lines[-1] for key, name in (
                ("d", "Dashboard"), ("m", "Models"), ("j", "Jobs"), ("e", "RL"), ("u", "Users"), ("k", "Keys"),
                ("a", "Audit"), ("q", "Quit"))
            ), f"the footer lists every screen's key: {lines[-1]}"
        subprocess.run(["tmux", "send-keys", "-t", session, "q"], check=True)
        waiting.until(lambda: ended(session), "q to quit the app (and so end the tmux session)", 15, interval_s=0.2)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


def test_the_audit_screen_left_open_a_minute_adds_at_most_one_record(running: Running, app: AdminApp) -> None:
    """`appliance tui` in tmux on the Audit screen, idle for a minute while it refreshes: the
    gateway counts the repeated query into its interval's summary instead of a record a poll."""
    session = f"appliance-tui-idle-{running.appliance.home.root.name}"
    environment = [arg for key, value in running.appliance.env.items() if key.startswith(("APPLIANCE_", "PATH"))
                   for arg in ("-e", f"{key}={value}")]

    def queries() -> int:
        return sum(1 for path in sorted(running.appliance.home.audit.glob("audit-*.jsonl"))
                   for line in path.read_bytes().splitlines() if b'"action":"audit.query"' in line)

    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "80", "-y", "24", *environment,
                    APPLIANCE, "tui"], check=True)
    try:
        shown(session, "restarts", "the dashboard")  # the app is up and takes keys
        subprocess.run(["tmux", "send-keys", "-t", session, "a"], check=True)
        shown(session, "Chain not verified", "the audit screen")
        # Its first query answered (the gateway records a query before it answers): a record's time
        # in the table.
        shown(session, RECORD_TIME, "the audit records")
        before = queries()
        time.sleep(60)  # the idle minute under test, while the screen refreshes
        assert queries() - before <= 1, "an idle audit screen adds at most one record a minute"
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


def test_status_of_the_running_appliance_breaks_no_word_at_80_columns(running: Running) -> None:
    """`appliance status` in an 80 x 24 tmux pane against the running session appliance: every
    program's name and state, and each column's heading, stand whole; `--wide` keeps each URL whole."""
    environment = {key: value for key, value in os.environ.items()
                   if not key.startswith("APPLIANCE_") and key not in ("COLUMNS", "LINES")}
    environment.update({key: value for key, value in running.appliance.env.items() if key.startswith("APPLIANCE_")})
    environment["TERM"] = "xterm-256color"
    report = json.loads(running.appliance.run("status", "--json", timeout=60).stdout)
    pane = Pane(environment)
    try:
        screen = pane.run(f"{APPLIANCE} status", timeout_s=120)
        wide = pane.run(f"{APPLIANCE} status --wide", timeout_s=120)
    finally:
        pane.close()
    words = {"program", "state", "health", "uptime", "serves", "model"}
    words |= {program["name"] for program in report["programs"]} | {program["state"] for program in report["programs"]}
    assert not broken(words, screen), "\n".join(screen)
    assert all(len(line) <= 80 for line in screen)
    urls = {url for program in report["programs"] for url in program["urls"].values()}
    assert urls and not broken(urls, wide), "\n".join(wide)
