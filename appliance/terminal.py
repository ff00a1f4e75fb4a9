"""Text for the terminal. Text from untrusted sources (a model's code, a program's output, names in
a task file) made safe to show on a terminal: control characters other than newline and tab
(escape sequences that could move the cursor, retitle the window or write the clipboard) and
invisible reordering characters become U+FFFD, and it is shown as text, never as Rich markup.
Lengths of time as one short word, so a table never breaks them. Listings whose ids stay whole at
any terminal width."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich.cells import cell_len
from rich.text import Text

if TYPE_CHECKING:  # rich.table only when a listing is drawn: `status` of a stopped appliance stays instant
    from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
    from rich.table import Table

# C0 and C1 controls but newline and tab, and the invisible characters that reorder or hide text
# (so code cannot show other than it runs).
UNSAFE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2060-\u2069\ufeff]")


def shown(text: str) -> Text:
    return Text(UNSAFE.sub("\ufffd", text))


def duration(seconds: float) -> str:
    """A length of time in at most two units, as one word: 42s, 5m03s, 2h05m, 3d04h."""
    s = int(seconds)
    days, hours, minutes = s // 86400, s // 3600 % 24, s // 60 % 60
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{s % 60:02d}s"
    return f"{s}s"


@dataclass(frozen=True)
class Field:
    """A listing's column. `whole`: ids, names, dates, states and numbers, which people copy, so
    never wrapped or cut; otherwise text (descriptions, messages) that wraps, and is left out
    first where the terminal is narrow."""

    header: str
    whole: bool = True


def text(header: str) -> Field:
    """A column of text that may wrap, and be left out where the terminal is too narrow."""
    return Field(header, whole=False)


TEXT_MIN = 12  # the narrowest a text column is wrapped to before it is left out instead
WORD_MAX = 30  # a longer word in a text column (a path, a URL) may be folded rather than leave it out


class Listing:
    """A table for a command's listing that keeps every id whole at any terminal width: text
    columns wrap, then are left out (the rightmost first, with a note naming them); when even the
    whole columns side by side are wider than the terminal, each row becomes a block of
    `header value` lines, so no id is ever wrapped, cut or shortened (an id wider than the whole
    terminal runs past its edge: print a listing with crop=False)."""

    def __init__(self, *fields: Field | str) -> None:
        self.fields = [f if isinstance(f, Field) else Field(f) for f in fields]
        self.rows: list[list[Text]] = []

    def add_row(self, *cells: str | Text) -> None:
        """One row, a cell per field; strings are shown as text, never as Rich markup."""
        if len(cells) != len(self.fields):
            raise ValueError(f"a row of {len(cells)} cells for {len(self.fields)} columns "
                             f"({', '.join(f.header for f in self.fields)})")
        self.rows.append([cell if isinstance(cell, Text) else shown(cell) for cell in cells])

    def natural(self, index: int) -> int:
        """The widest line of a column, its header included."""
        lines = [self.fields[index].header, *(line for row in self.rows for line in row[index].plain.split("\n"))]
        return max(cell_len(line) for line in lines)

    def narrowest(self, index: int) -> int:
        """The narrowest a text column is wrapped to: its longest word (up to WORD_MAX, past which
        a word is folded), at least TEXT_MIN, at most its natural width."""
        words = [self.fields[index].header, *(word for row in self.rows for word in row[index].plain.split())]
        return min(self.natural(index), max(TEXT_MIN, min(WORD_MAX, max(map(cell_len, words)))))

    def fitting(self, width: int) -> dict[int, int] | None:
        """The columns shown at `width` and their widths: every whole one at its natural width, and
        the text ones that still fit from the left, sharing what room is left; None when the whole
        ones alone do not fit side by side."""
        kept = {i: self.natural(i) if field.whole else self.narrowest(i) for i, field in enumerate(self.fields)}

        def room() -> int:  # one space between columns
            return width - sum(kept.values()) - (len(kept) - 1)

        while room() < 0 and (wrapping := [i for i in kept if not self.fields[i].whole]):
            del kept[wrapping[-1]]
        if room() < 0:
            return None
        growing = [i for i in kept if not self.fields[i].whole]
        while room() > 0 and (short := [i for i in growing if kept[i] < self.natural(i)]):
            for i in short[:room()]:
                kept[i] += 1
        return kept

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        kept = self.fitting(options.max_width)
        if kept is None:
            yield from self._blocks(options.max_width)
            return
        yield self._table(kept)
        left_out = [f.header for i, f in enumerate(self.fields) if i not in kept]
        if left_out:
            yield Text(f"(left out at this width: {', '.join(left_out)}; a wider terminal or --json shows them)",
                       style="dim")

    def _table(self, widths: dict[int, int]) -> Table:
        from rich.table import Column, Table

        # Fixed widths, computed above: Rich's own shrinking would take from the whole columns too.
        columns = [Column(self.fields[i].header, width=width, no_wrap=self.fields[i].whole,
                          overflow="ignore" if self.fields[i].whole else "fold") for i, width in widths.items()]
        table = Table(*columns, box=None, padding=(0, 1, 0, 0), pad_edge=False, header_style="bold")
        for row in self.rows:
            table.add_row(*(row[i] for i in widths))
        return table

    def _blocks(self, width: int) -> Iterator[RenderableType]:
        """Each row as `header value` lines (as psql's expanded display); a whole value too long
        to follow its header goes on a line of its own."""
        from rich.table import Column, Table

        label = max(cell_len(f.header) for f in self.fields)
        for number, row in enumerate(self.rows):
            if number:
                yield Text()
            for field, cell in zip(self.fields, row, strict=True):
                if field.whole and label + 2 + max(map(cell_len, cell.plain.split("\n"))) > width:
                    yield Text(field.header, style="bold")
                    # Past the terminal's width, a line the terminal wraps (its copy stays one line) if
                    # printed with crop=False, never a line break inside the value.
                    yield Text.assemble(cell, no_wrap=True, overflow="ignore")
                    continue
                grid = Table.grid(Column(width=label, style="bold"), Column(overflow="fold"), padding=(0, 2, 0, 0))
                grid.add_row(field.header, cell)
                yield grid
