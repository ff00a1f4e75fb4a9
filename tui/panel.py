"""The base of every screen: a banner for connection and login problems, a periodic reload in a
worker (never on the UI's own path), tables that keep the selected record across reloads and say
what belongs in them while empty, row actions offered only where they apply, and actions that
report their outcome and reload."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

from rich.text import Text
from textual.actions import parse
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
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
# An empty table shrinks to its column headers (its id's height rule would keep the space) and
# its note says below them what would be listed and how to get it there.
EMPTY_CSS = """
DataTable.none { height: auto !important; }
.empty { display: none; height: auto; padding: 0 1; color: $text-muted; }
.empty.shown { display: block; }
"""

Rows = list[tuple[str, tuple[Any, ...]]]  # (key, cells) per row


class Panel(Screen[None]):
    """Subclasses compose `body()` (tables through `listing()`) and fill it in `load()`; row
    actions say where they apply in `offers()`."""

    DEFAULT_CSS = BANNER_CSS + EMPTY_CSS
    REFRESH_S: ClassVar[float] = 5.0
    EMPTY: ClassVar[dict[str, str]] = {}  # a table's id -> what it says while empty

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

    def listing(self, table_id: str) -> ComposeResult:
        """A table and the note that takes its place while it is empty (`EMPTY[table_id]`)."""
        yield DataTable(id=table_id, cursor_type="row")
        yield Static(self.EMPTY[table_id], id=f"{table_id}-empty", classes="empty", markup=False)

    # Textual calls the handler of every class along the MRO: subclasses add their own on_mount
    # without calling this one (a second call would poll twice).
    def on_mount(self) -> None:
        self.set_interval(self.REFRESH_S, self.reload)

    def on_screen_resume(self) -> None:
        self.reload()

    def on_data_table_row_highlighted(self) -> None:
        self.show_offers()

    def reload(self) -> None:
        if self.app.screen is self:  # hidden screens wait until they are shown again
            # A callable, not a coroutine: an exclusive worker cancelled before it starts leaves
            # no never-awaited coroutine behind.
            self.run_worker(partial(self._guarded, self.load), group="load", exclusive=True)  # type: ignore[arg-type]  # textual's WorkType solves to Never for coroutine functions

    def fill(self, table_id: str, rows: Rows, empty: str | None = None, *, newest_first: bool = False) -> None:
        """Show `rows` in a table of `listing()`, or its note (`empty` instead of the usual one);
        `newest_first`: see `fill()`."""
        table = self.query_one(f"#{table_id}", DataTable)
        fill(table, rows, newest_first=newest_first)
        table.set_class(not rows, "none")
        note = self.query_one(f"#{table_id}-empty", Static)
        note.update(self.EMPTY[table_id] if empty is None else empty)
        note.set_class(not rows, "shown")
        self.show_offers()

    def selected(self, table_id: str) -> str | None:
        """The key of the selected row of a table."""
        return selected_key(self.query_one(f"#{table_id}", DataTable))

    # -- row actions: offered only where they apply -------------------------------------------

    def offers(self, action: str, parameters: tuple[object, ...]) -> bool:
        """Whether `action` applies to what is selected now (every action, unless overridden)."""
        return True

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # False hides the key from the footer and ignores it: an action that would be refused is
        # never offered.
        return self.offers(action, parameters)

    def show_offers(self) -> None:
        """The selection moved or the rows changed: show the keys that apply now."""
        self.refresh_bindings()
        self.show_keys()

    def show_keys(self) -> None:
        """Update the titles that list a table's keys (screens whose keys are not in the footer)."""

    def titled(self, title: str, actions: Sequence[str]) -> str:
        """`title` with the keys of those of `actions` that apply now: "Jobs (c: cancel)"."""
        keys = []
        for binding in bindings(self.BINDINGS):
            _, name, parameters = parse(binding.action)
            if name in actions and self.offers(name, parameters):
                keys.append(f"{binding.key}: {binding.description}")
        return f"{title} ({', '.join(keys)})" if keys else title

    async def _guarded(self, step: Callable[[], Awaitable[Any]]) -> bool:
        """Run `step`; show what went wrong in the banner (or a notification) instead of raising."""
        try:
            await step()
        except Unreachable as exc:
            self.show_problem(f"{exc} - retrying every {self.REFRESH_S:.0f} s")
            return False
        except NotLoggedIn as exc:
            self.show_problem(f"Not logged in: {exc.one_line()}")
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


def bindings(declared: list[BindingType]) -> list[Binding]:
    """The Binding objects of a BINDINGS list (which may also hold tuples)."""
    return [b for b in declared if isinstance(b, Binding)]


def selected_key(table: DataTable[Any]) -> str | None:
    """The key of the row under the cursor, if any."""
    if table.row_count == 0:
        return None
    return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value


def fill(table: DataTable[Any], rows: Rows, *, newest_first: bool = False) -> None:
    """Replace a table's rows (key, cells), keeping the cursor on the same record (by its key)
    wherever the record moved, and that record where it was on the screen: rows added above it
    scroll in above. If the record is gone, the cursor stays on the row that took its place.
    `newest_first` (a log with no row actions): a cursor on the first row at the top of the view,
    where the user has not moved it, stays there, on the newest record."""
    keep, row, above = selected_key(table), table.cursor_row, table.cursor_row - round(table.scroll_y)
    if newest_first and row == 0 and above == 0:
        keep = None
    scroll_x = table.scroll_x
    table.clear()  # it moves the cursor and the view to the top
    for key, cells in rows:
        # Text, not str: DataTable reads a str as Rich markup, and these values come from the
        # appliance (an audit record's resource may be "[/x]" or "[link=...]").
        table.add_row(*map(plain, cells), key=key)
    if not rows:
        return
    keys = [key for key, _ in rows]
    target = keys.index(keep) if keep in keys else min(row, len(rows) - 1)
    table.move_cursor(row=target, scroll=False)
    # After the refresh that sizes the new rows: scrolling before it stops at the old size.
    table.call_after_refresh(table.scroll_to, x=scroll_x, y=max(0, target - above), animate=False)


def plain(cell: Any) -> Text:
    """A cell as plain text (floats as DataTable shows them)."""
    if isinstance(cell, Text):
        return cell
    return Text(f"{cell:.2f}" if isinstance(cell, float) else str(cell))


def clip(text: str, width: int) -> str:
    """At most `width` characters: a long text (never an id, which people copy whole) ends in an
    ellipsis so the columns after it stay on an 80-column screen."""
    return text if len(text) <= width else text[:width - 1] + "…"


def gib(value: float) -> str:
    return f"{value / 2**30:.1f} GiB"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
