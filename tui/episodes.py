"""Agent episodes (`appliance rl episodes run`), newest first: how each ended, its reward, its
answers and calls and how many failed; below, the selected one's whole id and failures by tool.
Enter reads it (checked by the gateway against the digest it was kept with, and recorded: only
on Enter, never by a refresh) and shows it step by step as `appliance rl episodes show` does."""

from __future__ import annotations

from functools import partial
from urllib.parse import quote

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import DataTable, Label, Static

from appliance.admin_client import Refused
from appliance.rl.episodes import Episode, EpisodeEntry, failures_text, one_line, step_lines
from appliance.terminal import shown
from tui.panel import Panel, clip

STEPS_TITLE = "Steps (enter on an episode: read it; escape: back to the list)"


def entry_cells(entry: EpisodeEntry) -> tuple[object, ...]:
    """An episode's row, within 80 columns: its id short (whole in the line below the table)."""
    return (shown(entry.id[:8]), shown(clip(entry.task, 12)), shown(clip(entry.model, 10)), entry.ended,
            f"{entry.reward:.2f}", entry.answers, entry.tool_calls, sum(entry.failed_calls.values()))


def entry_line(entry: EpisodeEntry) -> str:
    """The selected episode's facts the row has no room for."""
    task_set = f" of task set {one_line(entry.task_set)}" if entry.task_set else ""
    return (f"Episode {one_line(entry.id)}: {one_line(entry.task)}{task_set}, model {one_line(entry.model)}, "
            f"{entry.seconds:.0f} s\nfailed calls by tool: {failures_text(entry.failed_calls)}")


class Episodes(Panel):
    DEFAULT_CSS = Panel.DEFAULT_CSS + """
    #episodes { height: auto; max-height: 8; }
    #episode { height: auto; max-height: 4; padding: 0 1; }
    #steps-scroll { height: 1fr; padding: 0 1; }
    Label { padding: 0 1; text-style: bold; }
    """
    # Named in the titles (the footer lists the screens; the RL screen's E leads here).
    BINDINGS = [Binding("escape", "list", "back to the list", show=False)]
    EMPTY = {"episodes": "No agent episodes yet: run one on a repository task with `appliance rl episodes run "
                         "--model MODEL --task FILE`."}

    def __init__(self) -> None:
        super().__init__()
        self.entries: dict[str, EpisodeEntry] = {}

    def body(self) -> ComposeResult:
        yield Label("Agent episodes, newest first (enter: show one)")
        yield from self.listing("episodes")
        yield Static("", id="episode", markup=False)
        yield Label(STEPS_TITLE, id="steps-title", markup=False)  # it names the id read
        with VerticalScroll(id="steps-scroll"):
            yield Static("", id="steps", markup=False)

    def on_mount(self) -> None:
        table = self.query_one("#episodes", DataTable)
        table.add_columns("id", "task", "model", "ended", "reward", "turns", "calls", "failed")
        table.focus()

    async def load(self) -> None:
        listed = [EpisodeEntry.model_validate(e) for e in await self.client.call("GET", "/rl/episodes")]
        self.entries = {entry.id: entry for entry in listed}
        self.fill("episodes", [(entry.id, entry_cells(entry)) for entry in reversed(listed)])  # newest first

    def show_keys(self) -> None:
        entry = self.entries.get(self.selected("episodes") or "")
        self.query_one("#episode", Static).update(entry_line(entry) if entry else "")

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if event.data_table.id == "episodes" and (key := event.row_key.value) in self.entries:
            self.run_worker(partial(self._guarded, partial(self._read, key)),  # type: ignore[arg-type]  # textual's WorkType solves to Never for coroutine functions
                            group="steps", exclusive=True)

    async def _read(self, episode_id: str) -> None:
        """The episode step by step, or why the gateway would not give it (gone, or changed in the
        artifact store since it was kept)."""
        try:
            found = Episode.model_validate(await self.client.call("GET", f"/rl/episodes/{quote(episode_id, safe='')}"))
            text = "\n".join(step_lines(found))
        except Refused as exc:
            if exc.status not in (404, 409):
                raise
            text = f"Episode {one_line(episode_id)} cannot be shown: {one_line(exc.reason)}"
        self.query_one("#steps-title", Label).update(f"Steps of episode {one_line(episode_id)} (escape: back to "
                                                     "the list)")
        self.query_one("#steps", Static).update(text)
        scroll = self.query_one("#steps-scroll", VerticalScroll)
        scroll.scroll_home(animate=False)
        scroll.focus()  # the arrow keys and page keys scroll it

    def action_list(self) -> None:
        self.query_one("#episodes", DataTable).focus()
