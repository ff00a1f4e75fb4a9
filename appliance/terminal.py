"""Text from untrusted sources (a model's code, a program's output, names in a task file) made safe
to show on a terminal: control characters other than newline and tab (escape sequences that could
move the cursor, retitle the window or write the clipboard) become U+FFFD, and it is shown as text,
never as Rich markup."""

from __future__ import annotations

import re

from rich.text import Text

UNSAFE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def shown(text: str) -> Text:
    return Text(UNSAFE.sub("\ufffd", text))
