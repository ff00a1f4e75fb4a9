"""Text for the terminal. Text from untrusted sources (a model's code, a program's output, names in
a task file) made safe to show on a terminal: control characters other than newline and tab
(escape sequences that could move the cursor, retitle the window or write the clipboard) and
invisible reordering characters become U+FFFD, and it is shown as text, never as Rich markup.
Lengths of time as one short word, so a table never breaks them."""

from __future__ import annotations

import re

from rich.text import Text

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
