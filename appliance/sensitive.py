"""Sensitive data in text: e-mail addresses, phone numbers, payment card numbers (Luhn-checked),
IBANs (mod-97-checked), API-key-like secrets, national identifiers, patterns the operator adds and
detectors that plug in. One scanner, built by `scanner_from` from the `compliance` settings,
serves dataset ingestion and RL export (finetune) and the gateway's live filtering of prompts and
answers (serve.compliance). Findings name the kind and where, never the matched text (it is what
must not leak).

Text is screened as a reader sees it: every detector runs on a normalised view of it (JSON
escapes read; NFKC; invisible and format characters removed; digits of every script as ASCII
digits; every dash as "-" and every space or line break as " "), and what it finds is mapped back
to the span of the original text that held it. The key and IBAN detectors also read look-alike
letters of other scripts as the ASCII they imitate (appliance.lookalikes: "GВ82" with a Cyrillic
Ve is "GB82"), one character for one; the card detector does not (another script's letters in a
short gap between digit groups separate them). Cards and IBANs are looked for across any run of
separators between their characters: anything that is not a digit or a Latin letter (any length),
or a gap of up to `GAP` characters holding other letters or numbers too.

A detector finds confirmed spans, and says where a finding may still be growing at the end of a
text that arrives in pieces (a streamed answer): `StreamRedactor` holds that tail back until it
is settled, so a card number split across two chunks is redacted whole.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import unicodedata
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Protocol

import numpy as np
import numpy.typing as npt
import regex

from appliance.errors import SettingsError
from appliance.key_shapes import SecretDetector
from appliance.lookalikes import FOLDED
from appliance.settings import ComplianceSettings

SHORT_TEXT = 64  # texts up to this long have their findings remembered
SHORT_TEXTS_CACHED = 4096
DETECTORS_GROUP = "appliance.detectors"  # entry points: a callable returning detectors


class Detector(Protocol):
    """What the scanner asks of a detector (built in, an operator's pattern, or a plug-in). It is
    given the normalised view of the text (see `View`)."""

    @property
    def kind(self) -> str:
        """What it finds (the policy's key, and what a finding is replaced by: [KIND])."""
        ...

    def find(self, text: str) -> Iterator[tuple[int, int]]:
        """(start, end) of each confirmed finding."""
        ...

    def pending(self, text: str) -> int | None:
        """Where a finding starts that more text could still complete or extend (None: nowhere)."""
        ...


# The normalised view.

INVISIBLE = regex.compile(r"[\p{Cf}\p{Default_Ignorable_Code_Point}]")  # zero-width, joiners, soft hyphen, VS...
WORD = regex.compile(r"[\p{L}\p{N}]")  # a letter or number
# Between digit groups, a gap of anything but digits and Latin letters joins them (a card written
# "4111ー1111ー..." with the katakana prolonged sound mark, or modifier letters, which look like
# dashes and apostrophes); one holding another script's letters or numbers only while it is short.
# Latin letters always part groups: hex digests and identifiers are not cards.
LATIN = regex.compile(r"[A-Za-z]")
GAP = 4  # the longest gap (characters as read) that may hold letters other than Latin ones
MINUS_SIGNS = frozenset("\u2212\u207b\u208b")  # minus signs (category Sm) read as dashes


def _as_read(char: str) -> str:
    """What one character is to a reader: NFKC, invisible ones dropped, digits as ASCII digits,
    dashes as "-", spaces and line breaks as " "."""
    seen = []
    for part in unicodedata.normalize("NFKC", char):
        if INVISIBLE.match(part):
            continue
        if part.isdecimal():
            seen.append(str(unicodedata.decimal(part)))
        elif (value := unicodedata.digit(part, None)) is not None:  # ❹, ➀, ፬: a digit to a reader too
            seen.append(str(value))
        elif unicodedata.category(part) == "Pd" or part in MINUS_SIGNS:
            seen.append("-")
        elif part.isspace():
            seen.append(" ")
        else:
            seen.append(part)
    return "".join(seen)


class _AsRead(dict[int, str]):
    """`_as_read` by code point, computed once per character (a `str.translate` table)."""

    def __missing__(self, code: int) -> str:
        self[code] = seen = _as_read(chr(code))
        return seen


class _Widths(dict[int, str]):
    """By code point: how many characters the view makes of it, as a character (`str.translate`)."""

    def __missing__(self, code: int) -> str:
        self[code] = width = chr(len(AS_READ[code]))
        return width


AS_READ, WIDTHS = _AsRead(), _Widths()


@dataclass(frozen=True)
class Resized:
    """Where a text made from another changed length: at each record, `width` characters of the
    made text (at `at`) come from `length` characters of the other (at `origin`); between records
    the two map one to one."""

    at: list[int] = field(default_factory=list)
    origin: list[int] = field(default_factory=list)
    length: list[int] = field(default_factory=list)
    width: list[int] = field(default_factory=list)

    def source(self, position: int) -> tuple[int, int]:
        """The span of the other text that the made text's character at `position` comes from."""
        record = bisect.bisect_right(self.at, position) - 1
        if record < 0:
            return position, position + 1
        at, origin, length, width = self.at[record], self.origin[record], self.length[record], self.width[record]
        if position < at + width:
            return origin, origin + length
        start = origin + length + position - at - width
        return start, start + 1

    def span(self, start: int, end: int) -> tuple[int, int]:
        """The span of the other text that [start, end) of the made text comes from."""
        if not self.at:
            return start, end
        return self.source(start)[0], self.source(end - 1)[1]


# As a tool call's arguments write text; one cut short at the end (a streamed piece) is read as a
# separator, so the digits before it are held until the next piece says what it is.
JSON_ESCAPE = regex.compile(r'(\\(?:u[dD][89abAB][0-9A-Fa-f]{2}\\u[dD][c-fC-F][0-9A-Fa-f]{2}|u[0-9A-Fa-f]{4}'
                            r'|["\\/bfnrt]|(?:u[0-9A-Fa-f]{0,3})?\Z))')  # a surrogate pair: one character
# What the next piece of a stream may complete: an escape cut short, or a pair's first half.
PARTIAL_ESCAPE = regex.compile(r"\\(?:u[dD][89abAB][0-9A-Fa-f]{2}(?:\\(?:u[0-9A-Fa-f]{0,3})?)?|u[0-9A-Fa-f]{0,3})?\Z")


class _Unescaped(dict[str, str]):
    """A JSON escape's character, by the escape."""

    def __missing__(self, escape: str) -> str:
        if escape == "\\" or escape[1] == "u" and len(escape) < 6:
            char = " "
        elif len(escape) == 12:  # a surrogate pair
            char = json.loads(f'"{escape}"')
        else:
            char = chr(int(escape[2:], 16)) if escape[1] == "u" else json.loads(f'"{escape}"')
        self[escape] = char
        return char


UNESCAPED = _Unescaped()


def _unescaped(text: str) -> tuple[str, Resized]:
    """`text` with JSON's escapes read ("4111\\n1111" is two lines to whoever parses it)."""
    parts = JSON_ESCAPE.split(text) if "\\" in text else [text]  # text, escape, text, ...
    if len(parts) == 1:
        return text, Resized()
    sizes = np.fromiter(map(len, parts), np.int64, len(parts))
    starts, lengths = (np.cumsum(sizes) - sizes)[1::2], sizes[1::2]
    at = starts - np.cumsum(lengths - 1) + lengths - 1  # shifted by the escapes before
    parts[1::2] = map(UNESCAPED.__getitem__, parts[1::2])
    return "".join(parts), Resized(at.tolist(), starts.tolist(), lengths.tolist(), [1] * len(at))


def _read(text: str) -> tuple[str, Resized]:
    """`text` as read character by character (`_as_read`)."""
    seen = text.translate(AS_READ)
    if text.isascii():
        return seen, Resized()
    widths = text.translate(WIDTHS)
    if len(seen) == len(text) and "\0" not in widths:  # none dropped, so none widened
        return seen, Resized()
    every = np.frombuffer(widths.encode("latin-1"), np.uint8).astype(np.int64)
    origin = np.flatnonzero(every != 1)
    width = every[origin]
    at = origin + np.cumsum(width - 1) - (width - 1)  # shifted by the resized ones before
    return seen, Resized(at.tolist(), origin.tolist(), [1] * len(origin), width.tolist())


@dataclass(frozen=True)
class View:
    """A text as a reader sees it (JSON escapes read, then each character as `_as_read` makes it),
    and the way back to the original text's spans."""

    text: str
    unescaped: Resized = field(default_factory=Resized)
    read: Resized = field(default_factory=Resized)

    @classmethod
    @functools.lru_cache(maxsize=4)  # a stream's held text is scanned twice: for findings, then what is pending
    def of(cls, text: str) -> View:
        plain, unescaped = _unescaped(text)
        seen, read = _read(plain)
        return cls(seen, unescaped, read)

    def span(self, start: int, end: int) -> tuple[int, int]:
        """The original span of the view's span [start, end) (what lies between its ends included)."""
        return self.unescaped.span(*self.read.span(start, end))


# Payment cards: every window of a run of digit groups (separators between them, no letters)
# that starts and ends at a group's edge, holds 13 to 19 digits and passes the Luhn check. The
# windows are checked all at once (numpy), so a megabyte of "1 1 1 ..." stays linear.

CARD_DIGITS = (13, 19)
RUN13 = regex.compile(r"[0-9](?:[^0-9A-Za-z]*[0-9]){12}")  # a run that could hold a card at all
TAIL_WORD = regex.compile(r"(?r)[A-Za-z]")  # the last Latin letter: no run reaches across it
GROUP = regex.compile(r"[0-9]+")
FEW_GROUPS = 64  # up to this many digit groups, a text's windows are checked one by one (cheaper than numpy's calls)
DOUBLED = np.array([0, 2, 4, 6, 8, 1, 3, 5, 7, 9])  # a Luhn-doubled digit's digit sum
Ints = npt.NDArray[np.int64]


class _Kinds(dict[int, str]):
    """By code point of the view: a digit itself, "w" for a Latin letter, "o" for another letter or
    number, "s" for a separator (`str.translate`)."""

    def __missing__(self, code: int) -> str:
        char = chr(code)
        kind = char if "0" <= char <= "9" else "w" if LATIN.match(char) else "o" if WORD.match(char) else "s"
        self[code] = kind
        return kind


def _parts(text: str, start: int, end: int) -> bool:
    """Whether the gap text[start:end] between two digit groups parts them."""
    return (LATIN.search(text, start, end) is not None
            or end - start > GAP and WORD.search(text, start, end) is not None)


KINDS = _Kinds()


@dataclass(frozen=True)
class _Groups:
    """The digit groups of a text: where each starts and ends (in the text and as digit offsets),
    the run each belongs to (runs are parted as `_parts` says), and Luhn sums of the digits so far, with
    the even (luhn[0]) or odd (luhn[1]) digit offsets doubled."""

    starts: Ints
    ends: Ints
    bounds: Ints  # digit offset of each group's first digit, and the count of digits last
    runs: Ints
    luhn: tuple[Ints, Ints]

    @classmethod
    def of(cls, text: str) -> _Groups:
        kinds = np.frombuffer(text.translate(KINDS).encode("ascii"), np.uint8).astype(np.int64)
        digit_at = np.flatnonzero((kinds >= ord("0")) & (kinds <= ord("9")))
        values = kinds[digit_at] - ord("0")
        first = np.flatnonzero(np.diff(digit_at, prepend=-2) != 1)
        bounds = np.append(first, len(digit_at))
        starts, ends = digit_at[first], digit_at[bounds[1:] - 1] + 1
        latin = np.concatenate(([0], np.cumsum(kinds == ord("w"))))
        other = np.concatenate(([0], np.cumsum(kinds == ord("o"))))
        gaps = starts[1:] - ends[:-1]
        parted = (latin[starts[1:]] != latin[ends[:-1]]) | ((gaps > GAP) & (other[starts[1:]] != other[ends[:-1]]))
        runs = np.concatenate(([0], np.cumsum(parted)))
        even = np.arange(len(values)) % 2 == 0
        luhn = (np.concatenate(([0], np.cumsum(np.where(even, DOUBLED[values], values)))),
                np.concatenate(([0], np.cumsum(np.where(even, values, DOUBLED[values])))))
        return cls(starts, ends, bounds, runs, luhn)

    def windows(self, groups: int) -> tuple[Ints, Ints]:
        """The first groups of the windows of `groups` groups that are cards, and each window's
        digit count (to stop once every window is too long)."""
        count = len(self.starts) - groups + 1
        first, last = self.bounds[:count], self.bounds[groups:]
        digits = last - first
        fits = (digits >= CARD_DIGITS[0]) & (digits <= CARD_DIGITS[1]) & (self.runs[:count] == self.runs[groups - 1:])
        candidates = np.flatnonzero(fits)
        begin, end = first[candidates], last[candidates]
        # The last digit is not doubled, nor every second one before it: those of the other parity.
        sums = np.where(end % 2 == 0, self.luhn[0][end] - self.luhn[0][begin], self.luhn[1][end] - self.luhn[1][begin])
        return candidates[sums % 10 == 0], digits


def _few_cards(text: str) -> list[tuple[int, int]]:
    """The cards of a text of few digit groups (as `_Groups` finds them, without numpy's cost per
    call): each window of groups checked in turn, overlapping ones merged."""
    groups = [match.span() for match in GROUP.finditer(text)]
    parted = [at == 0 or _parts(text, groups[at - 1][1], groups[at][0]) for at in range(len(groups))]
    found: list[tuple[int, int]] = []
    for first, (start, _) in enumerate(groups):
        digits = ""
        for last in range(first, len(groups)):
            digits += text[groups[last][0]:groups[last][1]]
            if len(digits) > CARD_DIGITS[1] or last > first and parted[last]:
                break
            if len(digits) >= CARD_DIGITS[0] and luhn_ok(digits):
                span = start, groups[last][1]
                if found and span[0] < found[-1][1]:  # windows come by start: only the last can overlap
                    span = found[-1][0], max(span[1], found.pop()[1])
                found.append(span)
    return found


def _merged(starts: Ints, ends: Ints) -> Iterator[tuple[int, int]]:
    """Overlapping spans as one: a valid number is never left half shown by another."""
    order = np.lexsort((ends, starts))
    starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends)
    new = np.flatnonzero(np.concatenate(([True], starts[1:] >= reach[:-1])))
    last = np.append(new[1:], len(starts)) - 1
    yield from zip(starts[new].tolist(), reach[last].tolist(), strict=True)


def _many_cards(text: str) -> Iterator[tuple[int, int]]:
    """The cards of a text (`_Groups`), overlapping ones merged."""
    groups = _Groups.of(text)
    starts, ends = [], []
    for size in range(1, min(CARD_DIGITS[1], len(groups.starts)) + 1):
        first, digits = groups.windows(size)
        starts.append(groups.starts[first])
        ends.append(groups.ends[first + size - 1])
        if digits.min() > CARD_DIGITS[1]:
            break
    if sum(map(len, starts)):
        yield from _merged(np.concatenate(starts), np.concatenate(ends))


@dataclass(frozen=True)
class CardDetector:
    kind: str = "payment_card"

    def find(self, text: str) -> Iterator[tuple[int, int]]:
        if RUN13.search(text) is None:
            return
        few = sum(1 for _ in itertools.islice(GROUP.finditer(text), FEW_GROUPS + 1)) <= FEW_GROUPS
        yield from _few_cards(text) if few else _many_cards(text)

    def pending(self, text: str) -> int | None:
        """The first group of the run the text ends in (nothing but separators after it) from
        which fewer than the most digits of a card have come yet."""
        last_word = TAIL_WORD.search(text)
        tail = last_word.end() if last_word else 0
        groups = [(match.start(), len(match.group())) for match in GROUP.finditer(text, tail)]
        digits = 0
        start = None
        for at, size in reversed(groups):
            digits += size
            if digits >= CARD_DIGITS[1]:
                break
            start = at
        return start


AS_DOUBLED = str.maketrans("0123456789", "0246813579")


def luhn_ok(digits: str) -> bool:
    """The Luhn check of ASCII digits: every second one from the last doubled (its digits summed)."""
    kept, doubled = digits[::-1][::2], digits[::-1][1::2].translate(AS_DOUBLED)
    return (sum(kept.encode()) + sum(doubled.encode()) - ord("0") * len(digits)) % 10 == 0


# IBANs: a country's code, its check digits and as many letters and digits as that country's IBANs
# have (separators anywhere after the code), passing the mod-97 check.

IBAN_LENGTHS = {
    "AD": 24, "AE": 23, "AL": 28, "AT": 20, "AZ": 28, "BA": 20, "BE": 16, "BG": 22, "BH": 22, "BI": 27, "BR": 29,
    "BY": 28, "CH": 21, "CR": 22, "CY": 28, "CZ": 24, "DE": 22, "DJ": 27, "DK": 18, "DO": 28, "EE": 20, "EG": 29,
    "ES": 24, "FI": 18, "FK": 18, "FO": 18, "FR": 27, "GB": 22, "GE": 22, "GI": 23, "GL": 18, "GR": 27, "GT": 28,
    "HN": 28, "HR": 21, "HU": 28, "IE": 22, "IL": 23, "IQ": 23, "IS": 26, "IT": 27, "JO": 30, "KW": 30, "KZ": 20,
    "LB": 28, "LC": 32, "LI": 21, "LT": 20, "LU": 20, "LV": 21, "LY": 25, "MC": 27, "MD": 24, "ME": 22, "MK": 19,
    "MN": 20, "MR": 27, "MT": 31, "MU": 30, "NI": 28, "NL": 18, "NO": 15, "OM": 23, "PK": 24, "PL": 28, "PS": 29,
    "PT": 25, "QA": 29, "RO": 24, "RS": 22, "RU": 33, "SA": 24, "SC": 31, "SD": 18, "SE": 24, "SI": 19, "SK": 24,
    "SM": 27, "SO": 23, "ST": 25, "SV": 28, "TL": 23, "TN": 24, "TR": 26, "UA": 29, "VA": 22, "VG": 24, "XK": 20,
    "YE": 30,
}
IBAN_SHAPE = regex.compile(r"(?<![A-Z0-9])[A-Z]{2}[ #]*(?:[0-9][ #]*){2}(?:[A-Z0-9][ #]*){11,30}")
AS_IBAN_DIGITS = {ord(c): str(int(c, 36)) for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ"}


class _IbanChars(dict[int, str]):
    """By code point of the view: an ASCII letter (upper-cased) or digit itself, a look-alike as
    the one it imitates, "#" for another letter or number, " " for a separator (`str.translate`):
    the IBAN's view of the view. A gap holding "#" parts an IBAN only when it is longer than `GAP`,
    as between a card's groups."""

    def __missing__(self, code: int) -> str:
        char = FOLDED[code]
        self[code] = seen = char.upper() if char.isascii() and char.isalnum() else "#" if WORD.match(char) else " "
        return seen


IBAN_CHARS = _IbanChars()


def iban_ok(text: str) -> bool:
    compact = text.replace(" ", "")
    moved = compact[4:] + compact[:4]
    return int(moved.upper().translate(AS_IBAN_DIGITS)) % 97 == 1


def _ibans(chars: str) -> Iterator[tuple[int, int]]:
    """Where `chars` (a view's IBAN_CHARS) holds IBANs: each start of a word with a country's code
    and two digits, then as many letters and digits (separators skipped) as that country's IBANs
    have, no gap among them parting them, passing mod 97 (all starts at once: the remainder of any
    stretch comes from sums so far)."""
    view = np.frombuffer(chars.encode("ascii"), np.uint8).astype(np.int64)
    at = np.flatnonzero((view != ord(" ")) & (view != ord("#")))  # the Latin letters and digits
    code = view[at]
    letter, digit = (code >= ord("A")) & (code <= ord("Z")), (code >= ord("0")) & (code <= ord("9"))
    starts = np.flatnonzero(np.diff(at, prepend=-2) > 1)  # at a word's start
    starts = starts[starts + 4 <= len(at)]
    starts = starts[letter[starts] & letter[starts + 1] & (at[starts + 1] == at[starts] + 1)
                    & digit[starts + 2] & digit[starts + 3]]
    lengths = IBAN_LENGTH_TABLE[(code[starts] - ord("A")) * 26 + code[starts + 1] - ord("A")]
    starts, lengths = starts[lengths > 0], lengths[lengths > 0]
    starts, lengths = starts[starts + lengths <= len(at)], lengths[starts + lengths <= len(at)]
    others = np.concatenate(([0], np.cumsum(view == ord("#"))))
    parting = (np.diff(at) - 1 > GAP) & (others[at[1:]] != others[at[:-1] + 1])  # between each two
    parted = np.concatenate(([0], np.cumsum(parting)))
    whole = parted[starts + lengths - 1] == parted[starts]
    starts, lengths = starts[whole], lengths[whole]
    # A letter counts as two digits (A = 10); the remainder of the digits of a stretch [a, b) is
    # (sums[b] - sums[a]) * 10^widths[b], with each digit's term scaled by 10^-(widths up to it).
    value = np.where(letter, code - ord("A") + 10, code - ord("0"))
    widths = np.concatenate(([0], np.cumsum(np.where(letter, 2, 1))))
    sums = np.concatenate(([0], np.cumsum(value * POW10[-widths[1:] % 96] % 97)))

    def remainder(a: Ints, b: Ints) -> Ints:
        return (sums[b] - sums[a]) % 97 * POW10[widths[b] % 96] % 97  # type: ignore[no-any-return]

    moved = (remainder(starts + 4, starts + lengths) * POW10[6] + remainder(starts, starts + 4)) % 97
    taken = 0
    for start, length in zip(starts[moved == 1].tolist(), lengths[moved == 1].tolist(), strict=True):
        if at[start] >= taken:
            yield int(at[start]), (taken := int(at[start + length - 1]) + 1)


IBAN_LENGTH_TABLE = np.zeros(26 * 26, np.int64)
for _code, _length in IBAN_LENGTHS.items():
    IBAN_LENGTH_TABLE[(ord(_code[0]) - ord("A")) * 26 + ord(_code[1]) - ord("A")] = _length
POW10 = np.array([pow(10, e, 97) for e in range(96)])  # 10^96 = 1 (mod 97)


@dataclass(frozen=True)
class IbanDetector:
    kind: str = "iban"

    def find(self, text: str) -> Iterator[tuple[int, int]]:
        chars = text.translate(IBAN_CHARS)
        if any(len(match.group().replace(" ", "").replace("#", "")) >= IBAN_LENGTHS.get(match.group()[:2], 99)
               for match in IBAN_SHAPE.finditer(chars, overlapped=True)):  # one could be an IBAN
            yield from _ibans(chars)

    def pending(self, text: str) -> int | None:
        # Each start where the rest of the text could begin an IBAN that is not yet as long as its
        # country's are.
        chars = text.translate(IBAN_CHARS)
        for match in IBAN_SHAPE.finditer(chars, partial=True, overlapped=True):
            if match.partial or IBAN_SHAPE.fullmatch(chars, pos=match.start(), partial=True) is not None:
                code = match.group()[:2]
                if len(code) < 2 or len(match.group().replace(" ", "").replace("#", "")) < IBAN_LENGTHS.get(code, 0):
                    return match.start()
        return None


@dataclass(frozen=True)
class PatternDetector:
    """A regular expression, and a check a match must pass."""

    kind: str
    pattern: regex.Pattern[str]
    confirm: Callable[[str], bool] = field(default=lambda match: True)

    @classmethod
    def of(cls, kind: str, pattern: str, confirm: Callable[[str], bool] | None = None) -> PatternDetector:
        return cls(kind, regex.compile(pattern), confirm or (lambda match: True))

    def find(self, text: str) -> Iterator[tuple[int, int]]:
        for match in self.pattern.finditer(text):
            if self.confirm(match.group()):
                yield match.span()

    def pending(self, text: str) -> int | None:
        # A match may still grow if the rest of the text from its start is the beginning of a
        # match (`partial`): "sk-abc" may go on.
        for match in self.pattern.finditer(text, partial=True):
            if match.partial or self.pattern.fullmatch(text, pos=match.start(), partial=True) is not None:
                return match.start()
        return None


NOT_PHONE_DIGITS = str.maketrans("", "", "+ ()./-")


def _phone(match: str) -> bool:
    digits = match.translate(NOT_PHONE_DIGITS)  # the view's digits are ASCII
    return 9 <= len(digits) <= 15 and not (CARD_DIGITS[0] <= len(digits) and luhn_ok(digits))


# Every repetition in these is bounded or cannot overlap the next, so a scan is linear in the text
# however hostile it is ("a@" + "a." * 100000 took seconds with open-ended ones). An operator's
# patterns are theirs.
BUILT_IN: tuple[Detector, ...] = (  # the strict kinds first: in an overlap the earlier detector wins
    IbanDetector(),  # before cards and keys: an IBAN's digits may hold a Luhn-valid run
    SecretDetector(),  # our key shapes and the vendored rules (appliance.key_shapes)
    CardDetector(),  # after keys: a key's digits may hold one
)
LOOSE: tuple[Detector, ...] = (  # after any other detector: a card joined to an e-mail address is a card
    PatternDetector.of("email", r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9._%+-]{1,64}@(?:[A-Za-z0-9-]{1,63}\.){1,8}"
                                r"[A-Za-z]{2,24}(?![A-Za-z0-9-])"),
    PatternDetector.of("phone", r"(?<![\w+])\+?\d[\d ()./-]{7,24}\d(?!\w)", _phone),
)


def national_ids() -> list[Detector]:
    """The `national_ids` plug-in (this package's own entry point, on by default): US social
    security numbers (written with dashes; never-issued areas left out) and UK national insurance
    numbers (the prefixes HMRC never issues left out)."""
    return [PatternDetector.of("national_id", r"\b(?!000|666|9\d\d)\d{3}-(?!00)\d{2}-(?!0000)\d{4}\b"),
            PatternDetector.of("national_id", r"\b(?!BG|GB|NK|KN|TN|NT|ZZ)[A-CEGHJ-PR-TW-Z][A-CEGHJ-NPR-TW-Z]"
                                              r" ?\d{2} ?\d{2} ?\d{2} ?[A-D]\b")]


def plugged(names: Iterable[str]) -> list[Detector]:
    """The detectors of the named `appliance.detectors` entry points."""
    available = {ep.name: ep for ep in entry_points(group=DETECTORS_GROUP)}
    found: list[Detector] = []
    for name in names:
        if name not in available:
            raise SettingsError(f"no sensitive-data detector {name!r} is installed",
                                hint=f"installed: {sorted(available) or 'none'} (entry points {DETECTORS_GROUP})")
        found += list(available[name].load()())
    return found


@dataclass(frozen=True)
class Finding:
    start: int
    end: int
    kind: str


class Scanner:
    """Finds and redacts sensitive spans: the built-in detectors, `extra` (named patterns) and
    `detectors` (plug-ins), each on the text as a reader sees it (`View`)."""

    def __init__(self, extra: dict[str, str] | None = None, detectors: Iterable[Detector] = ()) -> None:
        self.detectors: tuple[Detector, ...] = (
            *BUILT_IN, *(PatternDetector.of(kind, pattern) for kind, pattern in (extra or {}).items()), *detectors,
            *LOOSE)
        # A request's keys and short values ("role", "user", "content", a max_tokens) recur from
        # request to request: their findings are remembered (a bounded LRU of immutable results).
        self._short = functools.lru_cache(maxsize=SHORT_TEXTS_CACHED)(self._all)

    @property
    def kinds(self) -> set[str]:
        return {detector.kind for detector in self.detectors}

    def findings(self, text: str, kinds: set[str] | None = None) -> list[Finding]:
        """Every confirmed finding (of `kinds`, or all), in the original text, earlier detectors
        winning overlaps: the digits of an IBAN are never also a phone number."""
        return self.findings_by_rank(text, [set(self.kinds) if kinds is None else kinds])

    def findings_by_rank(self, text: str, ranks: Sequence[set[str]]) -> list[Finding]:
        """The findings of the kinds in `ranks`, overlaps settled rank by rank (the first rank's
        findings first, then the next's where they overlap none): a policy that blocks cards and
        only flags IBANs must not lose a card to an IBAN written around it."""
        asked = tuple(frozenset(rank) for rank in ranks)
        return list(self._short(text, asked) if len(text) <= SHORT_TEXT else self._all(text, asked))

    def _all(self, text: str, ranks: tuple[frozenset[str], ...]) -> tuple[Finding, ...]:
        view = View.of(text)
        taken: list[Finding] = []  # by start, never overlapping: only the one before a span can overlap it
        starts: list[int] = []
        for detector in (d for rank in ranks for d in self.detectors if d.kind in rank):
            for found in detector.find(view.text):
                start, end = view.span(*found)
                at = bisect.bisect_left(starts, end)
                if at == 0 or taken[at - 1].end <= start:
                    taken.insert(at, Finding(start, end, detector.kind))
                    starts.insert(at, start)
        return tuple(taken)

    def redact(self, text: str, kinds: set[str] | None = None) -> str:
        return replaced(text, self.findings(text, kinds))

    def finding_end(self, kind: str, start: str) -> regex.Pattern[str] | None:
        """What ends a finding of `kind` that begins with `start`, where its detector says (a
        detector's optional `ends`); None: the end of its word."""
        for detector in self.detectors:
            ends = getattr(detector, "ends", None)
            if detector.kind == kind and ends is not None and (until := ends(View.of(start).text)) is not None:
                return until  # type: ignore[no-any-return]
        return None

    def pending(self, text: str, kinds: set[str]) -> tuple[int, str | None]:
        """Where the settled part of `text` ends: before any finding of `kinds` more text could
        still complete or extend (and its kind)."""
        view = View.of(text)
        starts = [(start, detector.kind) for detector in self.detectors
                  if detector.kind in kinds and (start := detector.pending(view.text)) is not None]
        if not starts:
            return len(text), None
        start, kind = min(starts)
        return view.span(start, start + 1)[0], kind


def scanner_from(settings: ComplianceSettings) -> Scanner:
    """The scanner every use screens with: the built-in kinds, the operator's `compliance.patterns`
    and the plug-in `compliance.detectors` (SettingsError for one that is not installed)."""
    return Scanner(settings.patterns, plugged(settings.detectors))


def replaced(text: str, findings: list[Finding]) -> str:
    """`text` with each finding (by start, not overlapping) replaced by its kind: [PAYMENT_CARD]."""
    for finding in reversed(findings):
        text = f"{text[:finding.start]}[{finding.kind.upper()}]{text[finding.end:]}"
    return text


WORD_ENDS = frozenset(" \t\r\n\"'`<>,;()[]{}")
SWALLOWED_TAIL = 256  # longer than any end a detector names
END_SPLIT = 16  # longer than any end a detector names; shorter than a held finding's opening


class StreamRedactor:
    """Redacts `kinds` in a text that arrives in pieces. What could still be part of a finding is
    held back (at most `hold_chars`; a finding longer than that is redacted in the part that
    reaches the limit) until more text settles it or the text ends."""

    def __init__(self, scanner: Scanner, kinds: set[str], hold_chars: int) -> None:
        self.scanner = scanner
        self.kinds = kinds
        self.hold_chars = hold_chars
        self.held = ""
        self.found: set[str] = set()  # kinds redacted so far
        self.swallowing = False  # the rest of a finding too long to hold, to the end of its word
        self.until: regex.Pattern[str] | None = None  # or to the end its detector names (a PEM block's)
        self.swallowed = ""  # the last characters swallowed: an end may come split between pieces

    def feed(self, piece: str) -> str:
        """The part of the text so far that is settled, redacted."""
        if self.swallowing:
            piece = self._after_swallowed(piece)
            if not piece:
                return ""
        self.held += piece
        if not self.kinds:
            out, self.held = self.held, ""
            return out
        findings = self.scanner.findings(self.held, self.kinds)
        cut, kind = self.scanner.pending(self.held, self.kinds)
        if (partial := PARTIAL_ESCAPE.search(self.held)) is not None:
            cut = min(cut, partial.start())  # "\u00" then "34": the next piece says what it is
        for finding in findings:  # never cut through a finding
            if finding.start < cut < finding.end:
                cut = finding.start
        if kind is not None and len(self.held) - cut > self.hold_chars:
            # Longer than may be held and still growing (a 1 KB token, say): redacted now, and the
            # rest of it, to the end of its word (or the end its detector names), swallowed.
            out = self._emit(cut, [f for f in findings if f.end <= cut])  # what is held now starts it
            self.until = self.scanner.finding_end(kind, self.held)
            self.swallowed = self.held[-END_SPLIT:]  # an end begun in what is held now
            self.swallowing, self.held = True, ""
            self.found.add(kind)
            return f"{out}[{kind.upper()}]"
        return self._emit(cut, [f for f in findings if f.end <= cut])

    def _after_swallowed(self, piece: str) -> str:
        """What follows the end of the finding being swallowed in `piece` ("" while it goes on)."""
        if self.until is None:
            kept = next((at for at, char in enumerate(piece) if char in WORD_ENDS), len(piece))
            self.swallowing = kept == len(piece)
            return piece[kept:]
        self.swallowed += piece
        end = self.until.search(self.swallowed)
        if end is None:
            self.swallowed = self.swallowed[-SWALLOWED_TAIL:]
            return ""
        rest, self.swallowed, self.swallowing, self.until = self.swallowed[end.end():], "", False, None
        return rest

    def flush(self) -> str:
        """The rest, redacted: the text has ended."""
        return self._emit(len(self.held), self.scanner.findings(self.held, self.kinds))

    def _emit(self, cut: int, findings: list[Finding]) -> str:
        out, self.held = self.held[:cut], self.held[cut:]
        self.found |= {finding.kind for finding in findings}
        return replaced(out, findings)
