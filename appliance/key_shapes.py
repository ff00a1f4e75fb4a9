"""The `secret` detector: API keys and tokens by their providers' shapes. Two sources: a few shapes
of our own, looser than the providers' (a key cut short is still a key: `sk-` and 20 characters,
GitHub's and Slack's prefixes, JWTs, `AKIA`, spaces allowed between a key's first characters),
and the vendored gitleaks rules (appliance.key_rules).

A key prefix split by spaces or line breaks ("sk - ...", "AKI A...") is read joined: where a known
prefix (ours, or a rule's keyword of three characters or more) is spelled across spaces from the
start of a word, those spaces are dropped before the shapes are matched. Invisible characters are
already gone (the scanner's view), so this is the one reading left between a prefix and its key.

Look-alike letters of other scripts are read as the ASCII they imitate ("ѕк-", "АКIА": Cyrillic),
one character for one (appliance.lookalikes), before anything else: a finding's span is the
view's own.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import regex

from appliance.key_rules import Rule, rules
from appliance.lookalikes import folded


def _key(prefix: str, chars: str, least: int, most: int) -> str:
    """A key: its prefix, then its first `least` characters (spaces may split them: the view
    already dropped zero-width ones), then up to `most` in all, unbroken."""
    return rf"{prefix}(?: *{chars}){{{least}}}{chars}{{0,{most - least}}}+"


# Every repetition in these is bounded or cannot overlap the next, so a scan is linear in the text.
JWT_PART = _key("", "[A-Za-z0-9_-]", 10, 4096)
OWN = regex.compile(rf"(?<![A-Za-z0-9])(?:{_key('sk-', '[A-Za-z0-9_-]', 20, 256)}"
                    rf"|{_key('gh[pousr]_', '[A-Za-z0-9]', 36, 255)}"
                    rf"|{_key('github_pat_', '[A-Za-z0-9_]', 22, 255)}"
                    rf"|{_key('xox[abeprs]-', '[A-Za-z0-9-]', 10, 255)}"
                    rf"|(?<![_-])eyJ{JWT_PART} *\.{JWT_PART} *\.{JWT_PART})"
                    rf"|{_key('AKIA', '[0-9A-Z]', 16, 16)}")
OWN_PREFIXES = ("sk-", "ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_", "xoxa-", "xoxb-", "xoxe-", "xoxp-",
                "xoxr-", "xoxs-", "eyj", "akia")
LEAST_PREFIX = 3  # shorter keywords ("sk", "ey", "s.") are too common in prose to join across spaces
Ints = npt.NDArray[np.int64]
ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


@functools.cache
def prefixes() -> tuple[tuple[str, ...], frozenset[str]]:
    """The prefixes read joined (lower case), and every beginning of one (for a stream's tail)."""
    joined = sorted({*OWN_PREFIXES, *(keyword for rule in rules() for keyword in rule.keywords
                                      if len(keyword) >= LEAST_PREFIX and " " not in keyword)})
    return tuple(joined), frozenset(prefix[:size] for prefix in joined for size in range(1, len(prefix) + 1))


def _word_start(text: str, at: int) -> bool:
    return at == 0 or not text[at - 1].isalnum()


@functools.cache
def keywords() -> frozenset[str]:
    """Every rule's keywords (lower case)."""
    return frozenset(keyword for rule in rules() for keyword in rule.keywords)


def active(lower: str) -> list[Rule]:
    """The rules whose keywords the text (lower-cased) holds: the others cannot find anything."""
    present = {keyword for keyword in keywords() if keyword in lower}
    return [rule for rule in rules() if not present.isdisjoint(rule.keywords)] if present else []


@dataclass(frozen=True)
class _Joined:
    """A text with the spaces inside split prefixes dropped, and where each character came from."""

    text: str
    origin: Ints | None  # None: nothing dropped

    @classmethod
    @functools.lru_cache(maxsize=4)  # a stream's held text is scanned twice: for findings, then what is pending
    def of(cls, text: str) -> _Joined:
        if " " not in text:
            return cls(text, None)
        lower = text.translate(ASCII_LOWER)  # the prefixes are ASCII; one character stays one
        compact = lower.replace(" ", "")
        # Where a prefix is spelled across spaces, the compact text holds it more often.
        split = [prefix for prefix in prefixes()[0]
                 if prefix in compact and compact.count(prefix) > lower.count(prefix)]
        if not split:
            return cls(text, None)
        kept = np.flatnonzero(np.frombuffer(lower.encode("utf-32-le", "surrogatepass"), np.uint32) != ord(" "))
        dropped: set[int] = set()
        for prefix in split:
            at = compact.find(prefix)
            while at >= 0:
                start, end = int(kept[at]), int(kept[at + len(prefix) - 1])
                if end - start >= len(prefix) and _word_start(text, start):  # spelled across spaces
                    dropped.update(range(start, end))
                at = compact.find(prefix, at + 1)
        if not dropped:
            return cls(text, None)
        origin = np.array([at for at in range(len(text)) if at not in dropped or text[at] != " "], np.int64)
        return cls("".join(text[at] for at in origin.tolist()), origin)

    def span(self, start: int, end: int) -> tuple[int, int]:
        if self.origin is None:
            return start, end
        return int(self.origin[start]), int(self.origin[end - 1]) + 1

    def position(self, at: int) -> int:
        return at if self.origin is None else int(self.origin[at])


@functools.cache
def unled_shape() -> regex.Pattern[str]:
    """Our shapes and those of the rules not led by a keyword as one pattern: a stream's held text
    is asked once, not once a rule, whether such a key may be growing at its end."""
    shapes = (OWN.pattern, *(rule.pattern.pattern for rule in rules() if not rule.led))
    return regex.compile("|".join(f"(?:{shape})" for shape in shapes), regex.V1)


@functools.cache
def led_beginnings() -> tuple[frozenset[str], int]:
    """Every proper beginning of a keyword that leads its rule, and the longest keyword's length."""
    words = {keyword for rule in rules() if rule.led for keyword in rule.keywords}
    return frozenset(word[:size] for word in words for size in range(1, len(word))), max(map(len, words))


def _tail_keyword(lower: str) -> int | None:
    """Where the text's end begins a keyword that leads its rule ("gl", "glpa")."""
    beginnings, longest = led_beginnings()
    found = None
    for size in range(1, min(longest, len(lower) + 1)):
        if lower[-size:] in beginnings:
            found = len(lower) - size
    return found


def _partial_start(pattern: regex.Pattern[str], text: str) -> int | None:
    """Where a key starts that more text could complete or extend ("sk-abc" may go on): the first
    start where a shape matches the rest of the text in part, or whole and reaching its end (the
    one character a lookahead reads aside). Nothing, or spaces alone, are not held: the rules
    that open with a space also open at the start of a text, which is where the next piece's held
    text starts (so an answer's every trailing space is not held)."""
    for match in pattern.finditer(text, partial=True, overlapped=True):
        if match.partial or match.end() >= len(text) - 1 and pattern.fullmatch(
                text, pos=match.start(), partial=True) is not None:
            return None if not text[match.start():] or text[match.start():].isspace() else match.start()
    return None


# A private key's PEM block is longer than a stream may hold: once it is redacted, the rest is
# dropped up to where the vendored rule ends it, not only to the end of its first line.
PEM_START = regex.compile(r"(?i)-{5}BEGIN[ A-Z0-9_-]{0,100}PRIVATE KEY")
PEM_END = regex.compile(r"(?i)KEY(?: BLOCK)?-{5}")


@dataclass(frozen=True)
class SecretDetector:
    kind: str = "secret"

    def ends(self, start: str) -> regex.Pattern[str] | None:
        """What ends a key that begins with `start` and is too long to hold (None: its word's end)."""
        return PEM_END if PEM_START.match(folded(start)) else None

    def find(self, text: str) -> Iterator[tuple[int, int]]:
        joined = _Joined.of(folded(text))
        spans = [match.span() for match in OWN.finditer(joined.text)]
        for rule in active(joined.text.translate(ASCII_LOWER)):
            spans += rule.find(joined.text)
        merged: list[tuple[int, int]] = []
        for start, end in sorted(spans):
            if merged and start < merged[-1][1]:
                merged[-1] = merged[-1][0], max(end, merged[-1][1])
            else:
                merged.append((start, end))
        for start, end in merged:
            yield joined.span(start, end)

    def pending(self, text: str) -> int | None:
        """The earliest start of a key more text could complete or extend: a partial match of a
        shape (a rule led by a keyword only where its keyword is), a keyword's beginning at the end,
        or a word at the end that begins a prefix split by spaces ("AK", "sk ")."""
        joined = _Joined.of(folded(text))
        lower = joined.text.translate(ASCII_LOWER)
        shapes = (unled_shape(), *(rule.pattern for rule in active(lower) if rule.led))
        starts = [start for start in (*(_partial_start(shape, joined.text) for shape in shapes),
                                      _tail_keyword(lower), _tail_prefix(joined.text)) if start is not None]
        return joined.position(min(starts)) if starts else None


def _tail_prefix(text: str) -> int | None:
    """Where the text's end (spaces aside) begins a prefix from the start of a word."""
    beginnings = prefixes()[1]
    longest = max(map(len, prefixes()[0]))
    compact: list[tuple[int, str]] = []  # the last characters that are not spaces, from the end
    for at in range(len(text) - 1, -1, -1):
        if len(compact) == longest:
            break
        if text[at] != " ":
            compact.append((at, text[at].translate(ASCII_LOWER)))
    found = None
    spelled = ""
    for at, char in compact:
        spelled = char + spelled
        if spelled in beginnings and _word_start(text, at):
            found = at
    return found

