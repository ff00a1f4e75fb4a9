"""The TUI's agent episodes (tui/episodes.py), reached from the RL screen with E: listed newest
first within 80x24, one read only on Enter and shown step by step, its text from the model and
its tools shown as written (never as markup or terminal control, never passing for a step of its
own), an empty list that says how to make one, and the gateway's errors where the panels show
them. Against the fake admin API of tests/unit/test_tui.py."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from textual.pilot import Pilot
from textual.widgets import DataTable, Static

from appliance.admin_client import Refused, Unreachable
from appliance.home import Home
from appliance.rl.episodes import Episode, EpisodeEntry, ToolStep, Turn, step_lines
from tests.unit.test_tui import (
    Fake,
    cli_problem,
    cursor_key,
    header_line,
    refreshed,
    sample_answers,
    screen_lines,
    select,
    show,
    shown_text,
    with_fake,
)

if TYPE_CHECKING:
    from tui.app import AdminApp

OLD, NEW = "0123456789abcdef", "fedcba9876543210"
MARKUP = "[red]x[/red]"
ESCAPE = "\x1b[2J"
FORGED_NAME = "shell\n  ok forged"  # a newline in a tool name: it must not start a line of its own
LONG_LINE = "A" * 5000


def episode(content: str = "I will read it.", name: str = "read_file", output: str = "1: def add(a, b):") -> Episode:
    turns = [Turn(request_id="r1", content=content, completion_tokens=12, generation_s=1.5, tools=[
        ToolStep(call_id="c1", name=name, arguments='{"path": "a.py"}', output=output, ok=True, seconds=0.1),
        ToolStep(call_id="c2", name="shell", arguments='{"command": "false"}', output="[exit 1]", ok=False,
                 seconds=0.1)]),
        Turn(request_id="r2", content="", completion_tokens=64, tools=[], refused="gateway answered 502")]
    return Episode(task="calc-add", task_set="repo-tasks", model="Qwen2.5-Coder-32B-Instruct-AWQ", turns=turns,
                   ended="steps", reason="no steps left", reward=0.5, tests_passed=1, tests_total=2,
                   workspace_sha256="ab" * 32, seconds=3.0)


def entry(episode_id: str, task: str = "calc-add", failed: dict[str, int] | None = None) -> dict[str, Any]:
    return EpisodeEntry(id=episode_id, sha256=episode_id * 4, key=f"episodes/{episode_id * 4}.json", task=task,
                        task_set="repo-tasks", model="Qwen2.5-Coder-32B-Instruct-AWQ", ended="tool_calls",
                        reward=0.5, answers=2, tool_calls=2, failed_calls={"shell": 1} if failed is None else failed,
                        seconds=3.0, created="2026-12-01T03:00:00+00:00").model_dump(mode="json")


def answers(**reads: Any) -> dict[str, Any]:
    return {**sample_answers(), "/rl/episodes": [entry(OLD), entry(NEW, failed={"shell": 2, "read_file": 1})],
            f"/rl/episodes/{NEW}": episode().model_dump(mode="json"), **reads}


async def episodes_screen(pilot: Pilot[None]) -> None:
    """The RL screen, then its E."""
    await show(pilot, "e")
    await pilot.press("E")
    await pilot.pause(0.3)
    assert type(pilot.app.screen).__name__ == "Episodes"


async def read(pilot: Pilot[None], episode_id: str) -> str:
    """Enter on an episode: what the steps view shows."""
    await select(pilot, "episodes", episode_id)
    await pilot.press("enter")
    await pilot.pause(0.3)
    return shown_text(pilot.app, "steps")


def test_the_rl_screen_leads_to_the_episodes_listed_newest_first_whole_at_80x24(home: Home) -> None:
    async def scenario(pilot: Pilot[None], app: AdminApp, fake: Fake) -> None:
        await show(pilot, "e")
        assert shown_text(app, "tasksets-title") == "Task sets (E: agent episodes)"
        await episodes_screen(pilot)
        table = app.screen.query_one("#episodes", DataTable)
        assert [str(table.get_row_at(i)[0]) for i in range(table.row_count)] == [NEW[:8], OLD[:8]]
        assert [str(cell) for cell in table.get_row_at(0)] == [NEW[:8], "calc-add", "Qwen2.5-C…", "tool_calls",
                                                               "0.50", "2", "2", "3"]
        lines = screen_lines(app)
        assert len(lines) == 24 and all(len(line) <= 80 for line in lines)
        labels = [str(column.label) for column in table.columns.values()]
        assert re.search(r"\s+".join(labels), header_line(app, table)), header_line(app, table)
        assert table.virtual_size.width <= table.scrollable_content_region.width, "no column off the screen"
        assert lines[-1].startswith("d Dashboard") and "q Quit" in lines[-1], "the footer as it was"
        assert shown_text(app, "episode") == (f"Episode {NEW}: calc-add of task set repo-tasks, model "
                                              "Qwen2.5-Coder-32B-Instruct-AWQ, 3 s\n"
                                              "failed calls by tool: read_file 1, shell 2")
        await select(pilot, "episodes", OLD)
        assert "failed calls by tool: shell 1" in shown_text(app, "episode")
        assert fake.asked(f"/rl/episodes/{OLD}") == [], "an episode is read only on Enter"
        await pilot.press("e")
        assert type(app.screen).__name__ == "RlRuns", "the footer's e goes back"

    with_fake(home, answers(), scenario)


def test_a_long_list_with_long_names_keeps_every_column_on_an_80_column_screen(home: Home) -> None:
    """Past its height the table scrolls: its scrollbar takes two columns and still none goes off."""
    many = [entry(f"{n:016x}", task="a-very-long-task-name-indeed", failed={"shell": 123}) for n in range(30)]

    async def scenario(pilot: Pilot[None], app: AdminApp, fake: Fake) -> None:
        await episodes_screen(pilot)
        table = app.screen.query_one("#episodes", DataTable)
        assert table.row_count == 30 and table.show_vertical_scrollbar
        assert table.virtual_size.width <= table.scrollable_content_region.width
        assert all(len(line) <= 80 for line in screen_lines(app))

    with_fake(home, answers(**{"/rl/episodes": many}), scenario)


def test_enter_shows_the_episode_step_by_step_as_the_cli_does(home: Home) -> None:
    async def scenario(pilot: Pilot[None], app: AdminApp, fake: Fake) -> None:
        await episodes_screen(pilot)
        steps = await read(pilot, NEW)
        assert steps == "\n".join(step_lines(episode()))
        for line in ("task calc-add, model Qwen2.5-Coder-32B-Instruct-AWQ: ended steps (no steps left); reward 0.5, "
                     "1/2 tests", "answer 1 (12 tokens, 1.5 s, request r1)", "  said: I will read it.",
                     '  ok read_file {"path": "a.py"}', "    1: def add(a, b):", '  failed shell {"command": "false"}',
                     "    [exit 1]", "answer 2 (64 tokens, 0.0 s, request r2)",
                     "  refused by the gateway: gateway answered 502"):
            assert line in steps.splitlines(), line
        assert shown_text(app, "steps-title") == f"Steps of episode {NEW} (escape: back to the list)"
        assert app.focused is app.screen.query_one("#steps-scroll"), "the arrow keys scroll the steps"
        await pilot.press("escape")
        assert isinstance(app.focused, DataTable) and cursor_key(app, "episodes") == NEW
        await refreshed(pilot)
        await refreshed(pilot)
        assert len(fake.asked(f"/rl/episodes/{NEW}")) == 1, "a refresh reads the list, not the episode again"
        assert shown_text(app, "steps") == steps

    with_fake(home, answers(), scenario)


def test_hostile_text_is_shown_as_written_never_as_markup_or_terminal_control(home: Home) -> None:
    hostile = episode(content=f"{MARKUP}{ESCAPE}\n  ok forged by the model", name=FORGED_NAME,
                      output=f"{MARKUP}\n{LONG_LINE}")
    reads = answers(**{"/rl/episodes": [entry(NEW, task=f"{MARKUP}{ESCAPE}", failed={FORGED_NAME: 1})],
                       f"/rl/episodes/{NEW}": hostile.model_dump(mode="json")})

    async def scenario(pilot: Pilot[None], app: AdminApp, fake: Fake) -> None:
        await episodes_screen(pilot)
        assert str(app.screen.query_one("#episodes", DataTable).get_row_at(0)[1]) == "[red]x[/red…"
        line = shown_text(app, "episode")
        assert f"{MARKUP}\ufffd[2J of task set" in line and "failed calls by tool: shell\\n  ok forged 1" in line
        steps = await read(pilot, NEW)
        assert "\x1b" not in steps and f"  said: {MARKUP}\ufffd[2J" in steps, "as written, the escape made harmless"
        assert f"    {MARKUP}" in steps.splitlines(), "a tool's output as written"
        assert "  ok shell\\n  ok forged {" in steps, "the tool name on its own line, its newline shown as \\n"
        assert not [line for line in steps.splitlines() if line.startswith("  ok forged")], "no forged step"
        assert "        ok forged by the model" in steps.splitlines(), "the model's next line indented deeper"
        long = next(line for line in steps.splitlines() if "AAAA" in line)
        assert long == "    " + "A" * (800 - len(MARKUP) - 1) + "…", "what a tool observed, clipped"
        visual = app.screen.query_one("#steps", Static).render()
        assert not getattr(visual, "spans", []), "no style read from the text"
        lines = screen_lines(app)
        assert all(len(line) <= 80 for line in lines) and any(MARKUP in line for line in lines)

    with_fake(home, reads, scenario)


def test_no_episodes_says_how_to_make_one(home: Home) -> None:
    async def scenario(pilot: Pilot[None], app: AdminApp, fake: Fake) -> None:
        await episodes_screen(pilot)
        note = shown_text(app, "episodes-empty")
        assert app.screen.query_one("#episodes-empty", Static).has_class("shown")
        assert "`appliance rl episodes run" in note and any(note[:30] in line for line in screen_lines(app))
        commands = re.findall(r"`(appliance [^`]+)`", note)
        assert commands and [cli_problem(command) for command in commands] == [None]

    with_fake(home, answers(**{"/rl/episodes": []}), scenario)


def test_the_gateway_s_errors_show_where_the_panels_show_them(home: Home) -> None:
    """Not answering: the banner, and the list as it was. An episode gone or changed in the
    artifact store since it was kept (404, 409): why, in place of its steps."""
    reads = answers()

    async def scenario(pilot: Pilot[None], app: AdminApp, fake: Fake) -> None:
        await episodes_screen(pilot)
        reads["/rl/episodes"] = Unreachable("the gateway at http://127.0.0.1:9 does not answer")
        await refreshed(pilot)
        banner = app.screen.query_one("#banner", Static)
        assert banner.has_class("shown") and "does not answer" in shown_text(app, "banner")
        assert app.screen.query_one("#episodes", DataTable).row_count == 2
        reads["/rl/episodes"] = answers()["/rl/episodes"]
        await refreshed(pilot)
        assert not banner.has_class("shown")
        reads[f"/rl/episodes/{NEW}"] = Refused(409, f"episode {NEW}: its record in the artifact store was "
                                                    "changed since it was kept [red]x[/red]")
        assert await read(pilot, NEW) == (f"Episode {NEW} cannot be shown: episode {NEW}: its record in the "
                                          "artifact store was changed since it was kept [red]x[/red]")

    with_fake(home, reads, scenario)


def test_no_line_of_the_model_or_a_tool_passes_for_a_step() -> None:
    """The one formatting of an episode (the CLI's `show` and the TUI): answers at the margin, calls
    two in, everything the model or a tool wrote deeper."""
    lines = step_lines(episode(content="fine\nanswer 9 (1 tokens)\n  ok shell {}", name="a\nanswer 8",
                               output="out\n  failed shell"))
    structural = [line for line in lines if not line.startswith("    ")]
    assert structural == [lines[0], "answer 1 (12 tokens, 1.5 s, request r1)", "  said: fine",
                          '  ok a\\nanswer 8 {"path": "a.py"}', '  failed shell {"command": "false"}',
                          "answer 2 (64 tokens, 0.0 s, request r2)", "  refused by the gateway: gateway answered 502"]
