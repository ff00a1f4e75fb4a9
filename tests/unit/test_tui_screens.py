"""TUI screens that must not mislead: ids whole at 80x24, every supervised service visible (or
counted where the table scrolls), and the audit log's newest record in view while the user has
not moved the selection. Against the fake admin API of tests/unit/test_tui.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual.pilot import Pilot
from textual.widgets import DataTable

from appliance.home import Home
from tests.unit.test_tui import (
    Fake,
    audit_record,
    batch,
    cursor_key,
    refreshed,
    sample_answers,
    screen_lines,
    select,
    service,
    show,
    shown_text,
    with_fake,
)

if TYPE_CHECKING:
    from tui.app import AdminApp

USER = "svc-data-platform-ingest"  # 24 characters: clipped to 14 before
ACTION = "admin.keys.revoke-for-owner"
SERVICES = ["engine-main", "finetune-worker", "gateway", "grafana", "keycloak", "postgres", "prometheus",
            "rl-worker", "vllm-main", "watchdog"]


def test_the_audit_screen_shows_user_names_and_actions_whole_at_80x24(home: Home) -> None:
    answers = {**sample_answers(), "/audit": [audit_record(12, username=USER, action=ACTION)]}

    async def scenario(pilot: Pilot[None], app: AdminApp, fake: Fake) -> None:
        await show(pilot, "a")
        lines = screen_lines(app)
        assert any(USER in line and ACTION in line for line in lines), "\n".join(lines)

    with_fake(home, answers, scenario)


def test_every_service_shows_on_the_dashboard_at_120x40_with_a_count(home: Home) -> None:
    answers = {**sample_answers(), "/services": [service(name, "RUNNING") for name in SERVICES]}

    async def scenario(pilot: Pilot[None], app: AdminApp, fake: Fake) -> None:
        await show(pilot, "d")
        lines = screen_lines(app)
        for name in SERVICES:
            assert any(f" {name} " in line for line in lines), (name, "\n".join(lines))
        assert shown_text(app, "services-title").startswith("Services: 10")

    with_fake(home, answers, scenario, size=(120, 40))


def test_the_audit_screen_keeps_the_newest_record_in_view_until_the_user_moves(home: Home) -> None:
    answers = {**sample_answers(), "/audit": [audit_record(seq) for seq in (12, 11, 10)]}

    async def scenario(pilot: Pilot[None], app: AdminApp, fake: Fake) -> None:
        await show(pilot, "a")
        assert cursor_key(app, "records") == "12"
        fake.answers["/audit"] = [audit_record(seq) for seq in (14, 13, 12, 11, 10)]
        await refreshed(pilot)
        table = app.screen.query_one("#records", DataTable)
        assert cursor_key(app, "records") == "14" and table.scroll_y == 0, "the newest, at the top"
        await select(pilot, "records", "11")  # the user chose a record: it stays chosen
        fake.answers["/audit"] = [audit_record(seq) for seq in (15, 14, 13, 12, 11, 10)]
        await refreshed(pilot)
        assert cursor_key(app, "records") == "11"

    with_fake(home, answers, scenario)


def test_the_batches_table_names_each_batch_s_owner_at_80x24(home: Home) -> None:
    answers = {**sample_answers(), "/batches": {"object": "list", "data": [
        {**batch("batch_" + "e" * 24, "in_progress"), "owner": USER}]}}

    async def scenario(pilot: Pilot[None], app: AdminApp, fake: Fake) -> None:
        await show(pilot, "m")
        lines = screen_lines(app)
        assert any("batch_" + "e" * 24 in line and USER in line for line in lines), "\n".join(lines)

    with_fake(home, answers, scenario)


def test_the_rl_runs_table_shows_model_and_task_set_whole_at_80x24(home: Home) -> None:
    """Their attempts and mean reward, for which the row has no room, are in the selected run's line."""

    async def scenario(pilot: Pilot[None], app: AdminApp, fake: Fake) -> None:
        await show(pilot, "e")
        lines = screen_lines(app)
        assert any("Qwen2.5-Coder-32B-Instruct-AWQ" in line and "starter-python-functions" in line
                   for line in lines), "\n".join(lines)
        await select(pilot, "runs", "2")
        assert "30/40 attempts, mean reward 0.512" in shown_text(app, "run")

    with_fake(home, sample_answers(), scenario)
