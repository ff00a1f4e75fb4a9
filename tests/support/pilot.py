"""Driving the administrator's terminal UI with Textual's pilot: run a scenario headless, wait for
the screen to show something, read its tables and texts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from textual.pilot import Pilot
from textual.widgets import DataTable, Static

from tui.app import AdminApp

SIZE = (80, 24)


def drive(app: AdminApp, scenario: Callable[[Pilot[object]], Awaitable[None]]) -> list[str]:
    """Run `scenario` against the app in an 80x24 headless terminal; the notifications it showed."""
    shown: list[str] = []
    notify = app.notify

    def recorded(message: str, **kwargs: object) -> None:
        shown.append(str(message))
        notify(message, **kwargs)  # type: ignore[arg-type]

    app.notify = recorded  # type: ignore[method-assign,assignment]

    async def run() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await scenario(pilot)

    asyncio.run(run())
    return shown


async def until(pilot: Pilot[object], check: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    """Wait until `check()` holds; on timeout, fail showing the screen."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        await pilot.pause(0.2)
    raise AssertionError(f"timed out waiting for {what}; screen:\n{screen_text(pilot.app)}")


def rows(app: AdminApp, table: str) -> dict[str, list[str]]:
    """The table's rows on the current screen by key, cells as text."""
    found = app.screen.query_one(f"#{table}", DataTable)
    return {str(key.value): [str(cell) for cell in found.get_row(key)] for key in found.rows}


def text(app: AdminApp, widget: str) -> str:
    """What a Static on the current screen shows."""
    return str(app.screen.query_one(f"#{widget}", Static).render())


def screen_text(app: AdminApp) -> str:
    """What a failing wait shows: the screen's text, its tables and the notifications so far."""
    return "\n".join([*(str(s.render()) for s in app.screen.query(Static)),
                      *(f"{t.id}: {rows(app, t.id or '')}" for t in app.screen.query(DataTable)),
                      *(f"notified: {n.message}" for n in app._notifications)])


async def select_row(pilot: Pilot[object], table: str, key: str) -> None:
    """Focus the table and put its cursor on the row with `key`."""
    found = pilot.app.screen.query_one(f"#{table}", DataTable)
    found.focus()
    found.move_cursor(row=found.get_row_index(key))
    await pilot.pause()
