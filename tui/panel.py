"""The base of every screen: a banner for connection and login problems, a periodic reload in a
worker (never on the UI's own path), and actions that report their outcome and reload."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Static

from appliance.admin_client import AdminClient, NotLoggedIn, Refused, Unreachable
from tui.dialogs import Confirm

if TYPE_CHECKING:
    from tui.app import AdminApp

BANNER_CSS = """
#banner { display: none; background: $error; color: $text; padding: 0 1; height: auto; }
#banner.shown { display: block; }
"""


class Panel(Screen[None]):
    """Subclasses compose `body()` and fill it in `load()`."""

    DEFAULT_CSS = BANNER_CSS
    REFRESH_S: ClassVar[float] = 5.0

    app: AdminApp

    @property
    def client(self) -> AdminClient:
        return self.app.client

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("", id="banner", markup=False)
        yield from self.body()
        yield Footer(compact=True, show_command_palette=False)

    def body(self) -> ComposeResult:
        raise NotImplementedError

    async def load(self) -> None:
        """Fetch what the screen shows and update its widgets."""
        raise NotImplementedError

    def on_mount(self) -> None:
        self.set_interval(self.REFRESH_S, self.reload)

    def on_screen_resume(self) -> None:
        self.reload()

    def reload(self) -> None:
        if self.app.screen is self:  # hidden screens wait until they are shown again
            # A callable, not a coroutine: an exclusive worker cancelled before it starts leaves
            # no never-awaited coroutine behind.
            self.run_worker(partial(self._guarded, self.load), group="load", exclusive=True)  # type: ignore[arg-type]  # textual's WorkType solves to Never for coroutine functions

    async def _guarded(self, step: Callable[[], Awaitable[Any]]) -> bool:
        """Run `step`; show what went wrong in the banner (or a notification) instead of raising."""
        try:
            await step()
        except Unreachable as exc:
            self.show_problem(f"{exc} - retrying every {self.REFRESH_S:.0f} s")
            return False
        except NotLoggedIn as exc:
            self.show_problem(f"Not logged in: {exc} - press L to log in")
            return False
        except Refused as exc:
            self.notify(exc.reason, title=f"refused ({exc.status})", severity="error", timeout=8, markup=False)
            return False
        self.show_problem(None)
        return True

    def show_problem(self, text: str | None) -> None:
        banner = self.query_one("#banner", Static)
        banner.update(text or "")
        banner.set_class(text is not None, "shown")

    def act(self, step: Callable[[], Awaitable[Any]], done: str, question: str | None = None) -> None:
        """Run a changing action (after a confirmation when `question`), say how it went, reload."""

        async def run() -> None:
            if await self._guarded(step):
                self.notify(done, timeout=5, markup=False)
            self.reload()

        if question is None:
            self.run_worker(run, group="act")  # type: ignore[arg-type]  # textual's WorkType solves to Never for coroutine functions
            return

        def confirmed(answer: bool | None) -> None:
            if answer:
                self.run_worker(run, group="act")  # type: ignore[arg-type]  # textual's WorkType solves to Never for coroutine functions

        self.app.push_screen(Confirm(question), confirmed)


def selected_key(table: DataTable[Any]) -> str | None:
    """The key of the row under the cursor, if any."""
    if table.row_count == 0:
        return None
    return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value


def fill(table: DataTable[Any], rows: list[tuple[str, tuple[Any, ...]]]) -> None:
    """Replace a table's rows (key, cells), keeping the cursor on the same key where it still is."""
    keep = selected_key(table)
    table.clear()
    for key, cells in rows:
        # Text, not str: DataTable reads a str as Rich markup, and these values come from the
        # appliance (an audit record's resource may be "[/x]" or "[link=...]").
        table.add_row(*map(plain, cells), key=key)
    keys = [key for key, _ in rows]
    if keep in keys:
        table.move_cursor(row=keys.index(keep))


def plain(cell: Any) -> Text:
    """A cell as plain text (floats as DataTable shows them)."""
    if isinstance(cell, Text):
        return cell
    return Text(f"{cell:.2f}" if isinstance(cell, float) else str(cell))


def gib(value: float) -> str:
    return f"{value / 2**30:.1f} GiB"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
