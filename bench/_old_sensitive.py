"""The sensitive-data scanner as it was before it normalised text (appliance/sensitive.py at the
commit before), kept only as the baseline of bench/compliance_cost.py: nothing else imports it."""


from __future__ import annotations

import bisect
import unicodedata
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Protocol

import regex

from appliance.errors import SettingsError

DETECTORS_GROUP = "appliance.detectors"  # entry points: a callable returning detectors


class Detector(Protocol):
    """What the scanner asks of a detector (built in, an operator's pattern, or a plug-in)."""

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


TRIM = 2  # groups a checksummed match may hold after the finding ("12/29" after a card)
MOST_GROUPS = 8  # a match of more groups ("1 1 1 1 ...") is no written card or IBAN: not searched again inside


def _next_group(text: str, start: int, end: int) -> int | None:
    """Where the second group of text[start:end] starts, if it has 2 to MOST_GROUPS groups."""
    separators = [m.end() for m in regex.finditer(r"(?<=[^\W_])[\W_]+(?=[^\W_])", text, pos=start, endpos=end)]
    return separators[0] if 0 < len(separators) < MOST_GROUPS else None


@dataclass(frozen=True)
class PatternDetector:
    """A regular expression, and a check a match must pass (a checksum, say)."""

    kind: str
    pattern: regex.Pattern[str]
    confirm: Callable[[str], bool] = field(default=lambda match: True)
    windows: bool = False  # a match that fails its check may hold one that passes (checksummed kinds)

    @classmethod
    def of(cls, kind: str, pattern: str, confirm: Callable[[str], bool] | None = None,
           windows: bool = False) -> PatternDetector:
        return cls(kind, regex.compile(pattern), confirm or (lambda match: True), windows)

    def find(self, text: str) -> Iterator[tuple[int, int]]:
        at = 0
        while (match := self.pattern.search(text, at)) is not None:
            found = self._confirmed(text, *match.span())
            if found is not None:
                yield found
                at = found[1]
            elif self.windows and (second := _next_group(text, *match.span())) is not None:
                # A checksummed kind is looked for again from the match's next group: the card in
                # "12 34 4111 1111 1111 1111" begins inside a match that failed its check.
                at = second
            else:
                at = match.end()

    def _confirmed(self, text: str, start: int, end: int) -> tuple[int, int] | None:
        """The match if it passes its check; else (a checksummed kind) the longest of it without up
        to TRIM of its last groups (what separators part) that matches and passes: the card in
        "4111 1111 1111 1111 12/29"."""
        if self.confirm(text[start:end]):
            return start, end
        if not self.windows:
            return None
        ends = [start + m.start() for m in regex.finditer(r"(?<=[^\W_])[\W_]+", text[start:end])]
        for cut in reversed(ends[-TRIM:]):
            if self.confirm(text[start:cut]) and self.pattern.fullmatch(text, pos=start, endpos=cut):
                return start, cut
        return None

    def pending(self, text: str) -> int | None:
        # A match may still grow if the rest of the text from its start is the beginning of a
        # match (`partial`): "GB82 WEST 1234 5698 " matches as far as "5698" and may go on.
        for match in self.pattern.finditer(text, partial=True):
            if match.partial or self.pattern.fullmatch(text, pos=match.start(), partial=True) is not None:
                return match.start()
        return None


def luhn_ok(digits: str) -> bool:
    total = 0
    for position, char in enumerate(reversed(digits)):
        value = int(char)
        if position % 2:
            value = value * 2 - 9 if value > 4 else value * 2
        total += value
    return total % 10 == 0


def iban_ok(text: str) -> bool:
    compact = text.replace(" ", "")
    moved = compact[4:] + compact[:4]
    return int("".join(str(int(c, 36)) for c in moved)) % 97 == 1


def _digits(match: str) -> str:
    return "".join(str(unicodedata.decimal(c)) for c in match if c.isdecimal())


def iban_checked(text: str) -> bool:
    compact = "".join(str(unicodedata.decimal(c)) if c.isdecimal() else c for c in text if c.isalnum())
    return compact.isascii() and iban_ok(compact.upper())


def _card(match: str) -> bool:
    digits = _digits(match)
    return 13 <= len(digits) <= 19 and luhn_ok(digits)


def _phone(match: str) -> bool:
    return 9 <= len(_digits(match)) <= 15 and not _card(match)


# Every repetition in these is bounded, so a scan is linear in the text however hostile it is
# ("a@" + "a." * 100000 took seconds with open-ended ones). An operator's patterns are theirs.
SEPARATOR = r"[ \-./_\u00a0\u2009\u202f\u200b\u00ad]"  # between a card's or an IBAN's digits
BUILT_IN = (  # the strict kinds first: in an overlap the earlier detector wins
    PatternDetector.of("payment_card", rf"(?<!\d)(?:\d{SEPARATOR}{{0,2}}){{12,18}}\d(?!\d)", _card, windows=True),
    PatternDetector.of("iban", rf"(?<![^\W_])[A-Za-z]{{2}}\d{{2}}(?:{SEPARATOR}?[A-Za-z0-9]){{11,30}}(?![^\W_])",
                       iban_checked, windows=True),
    PatternDetector.of("secret", r"(?<![A-Za-z0-9])(?:sk-[A-Za-z0-9_-]{20,256}|gh[pousr]_[A-Za-z0-9]{36,255}"
                                 r"|xox[abpr]-[A-Za-z0-9-]{10,255}"
                                 r"|eyJ[A-Za-z0-9_-]{10,4096}\.[A-Za-z0-9_-]{10,4096}\.[A-Za-z0-9_-]{10,4096})"
                                 r"|AKIA[0-9A-Z]{16}"),
)
LOOSE = (  # after any other detector: a card joined to an e-mail address is a card
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
    `detectors` (plug-ins)."""

    def __init__(self, extra: dict[str, str] | None = None, detectors: Iterable[Detector] = ()) -> None:
        self.detectors: tuple[Detector, ...] = (
            *BUILT_IN, *(PatternDetector.of(kind, pattern) for kind, pattern in (extra or {}).items()), *detectors,
            *LOOSE)

    @property
    def kinds(self) -> set[str]:
        return {detector.kind for detector in self.detectors}

    def findings(self, text: str, kinds: set[str] | None = None) -> list[Finding]:
        """Every confirmed finding (of `kinds`, or all), earlier detectors winning overlaps: the
        digits of an IBAN are never also a phone number."""
        taken: list[Finding] = []  # by start, never overlapping: only the one before a span can overlap it
        starts: list[int] = []
        for detector in self.detectors:
            for start, end in detector.find(text):
                at = bisect.bisect_left(starts, end)
                if at == 0 or taken[at - 1].end <= start:
                    taken.insert(at, Finding(start, end, detector.kind))
                    starts.insert(at, start)
        return [f for f in taken if kinds is None or f.kind in kinds]

    def redact(self, text: str, kinds: set[str] | None = None) -> str:
        return _replaced(text, self.findings(text, kinds))

    def pending(self, text: str, kinds: set[str]) -> tuple[int, str | None]:
        """Where the settled part of `text` ends: before any finding of `kinds` more text could
        still complete or extend (and its kind)."""
        starts = [(start, detector.kind) for detector in self.detectors if detector.kind in kinds
                  if (start := detector.pending(text)) is not None]
        return min(starts, default=(len(text), None))


def _replaced(text: str, findings: list[Finding]) -> str:
    for finding in reversed(findings):
        text = f"{text[:finding.start]}[{finding.kind.upper()}]{text[finding.end:]}"
    return text


WORD_ENDS = frozenset(" \t\r\n\"'`<>,;()[]{}")


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

    def feed(self, piece: str) -> str:
        """The part of the text so far that is settled, redacted."""
        if self.swallowing:
            kept = next((at for at, char in enumerate(piece) if char in WORD_ENDS), len(piece))
            piece = piece[kept:]
            if not piece:
                return ""
            self.swallowing = False
        self.held += piece
        if not self.kinds:
            out, self.held = self.held, ""
            return out
        findings = self.scanner.findings(self.held, self.kinds)
        cut, kind = self.scanner.pending(self.held, self.kinds)
        for finding in findings:  # never cut through a finding
            if finding.start < cut < finding.end:
                cut = finding.start
        if kind is not None and len(self.held) - cut > self.hold_chars:
            # Longer than may be held and still growing (a 1 KB token, say): redacted now, and the
            # rest of it, to the end of its word, swallowed.
            out = self._emit(cut, [f for f in findings if f.end <= cut])
            self.swallowing, self.held = True, ""
            self.found.add(kind)
            return f"{out}[{kind.upper()}]"
        return self._emit(cut, [f for f in findings if f.end <= cut])

    def flush(self) -> str:
        """The rest, redacted: the text has ended."""
        return self._emit(len(self.held), self.scanner.findings(self.held, self.kinds))

    def _emit(self, cut: int, findings: list[Finding]) -> str:
        out, self.held = self.held[:cut], self.held[cut:]
        self.found |= {finding.kind for finding in findings}
        return _replaced(out, findings)
