"""Sensitive data in text: e-mail addresses, phone numbers, payment card numbers (Luhn-checked),
IBANs (mod-97-checked), API-key-like secrets, national identifiers, patterns the operator adds and
detectors that plug in. One scanner serves training datasets (finetune) and the gateway's live
filtering of prompts and answers (serve.compliance). Findings name the kind and where, never the
matched text (it is what must not leak).

A detector finds confirmed spans, and says where a finding may still be growing at the end of a
text that arrives in pieces (a streamed answer): `StreamRedactor` holds that tail back until it
is settled, so a card number split across two chunks is redacted whole.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class PatternDetector:
    """A regular expression, and a check a match must pass (a checksum, say)."""

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
    return "".join(c for c in match if c.isdigit())


def _card(match: str) -> bool:
    digits = _digits(match)
    return 13 <= len(digits) <= 19 and luhn_ok(digits)


def _phone(match: str) -> bool:
    return 9 <= len(_digits(match)) <= 15 and not _card(match)


BUILT_IN = (  # the specific kinds; the phone number, the loosest, comes after any other detector
    PatternDetector.of("email", r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}\b"),
    PatternDetector.of("payment_card", r"(?<!\d)(?:\d[ -]?){12,18}\d(?!\d)", _card),
    PatternDetector.of("iban", r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]){11,30}\b", iban_ok),
    PatternDetector.of("secret", r"\b(?:sk-[A-Za-z0-9_-]{20,}|AKIA[0-9A-Z]{16}|gh[pousr]_[A-Za-z0-9]{36,}"
                                 r"|xox[abpr]-[A-Za-z0-9-]{10,}"
                                 r"|eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,})\b"),
)
PHONE = PatternDetector.of("phone", r"(?<![\w+])\+?\d[\d ()./-]{7,}\d(?!\w)", _phone)


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
            PHONE)

    @property
    def kinds(self) -> set[str]:
        return {detector.kind for detector in self.detectors}

    def findings(self, text: str, kinds: set[str] | None = None) -> list[Finding]:
        """Every confirmed finding (of `kinds`, or all), earlier detectors winning overlaps: the
        digits of an IBAN are never also a phone number."""
        taken: list[Finding] = []
        for detector in self.detectors:
            for start, end in detector.find(text):
                if not any(f.start < end and start < f.end for f in taken):
                    taken.append(Finding(start, end, detector.kind))
        return sorted((f for f in taken if kinds is None or f.kind in kinds), key=lambda f: f.start)

    def spans(self, text: str) -> list[tuple[int, int, str]]:
        return [(f.start, f.end, f.kind) for f in self.findings(text)]

    def redact(self, text: str, kinds: set[str] | None = None) -> str:
        return _replaced(text, self.findings(text, kinds))

    def pending(self, text: str, kinds: set[str]) -> int:
        """Where the settled part of `text` ends: before any finding of `kinds` more text could
        still complete or extend."""
        starts = [start for detector in self.detectors if detector.kind in kinds
                  if (start := detector.pending(text)) is not None]
        return min(starts, default=len(text))


def _replaced(text: str, findings: list[Finding]) -> str:
    for finding in reversed(findings):
        text = f"{text[:finding.start]}[{finding.kind.upper()}]{text[finding.end:]}"
    return text


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

    def feed(self, piece: str) -> str:
        """The part of the text so far that is settled, redacted."""
        self.held += piece
        if not self.kinds:
            out, self.held = self.held, ""
            return out
        findings = self.scanner.findings(self.held, self.kinds)
        cut = max(self.scanner.pending(self.held, self.kinds), len(self.held) - self.hold_chars)
        for finding in findings:  # never cut through a finding
            if finding.start < cut < finding.end:
                cut = finding.start if len(self.held) - finding.start <= self.hold_chars else finding.end
        return self._emit(cut, [f for f in findings if f.end <= cut])

    def flush(self) -> str:
        """The rest, redacted: the text has ended."""
        return self._emit(len(self.held), self.scanner.findings(self.held, self.kinds))

    def _emit(self, cut: int, findings: list[Finding]) -> str:
        out, self.held = self.held[:cut], self.held[cut:]
        self.found |= {finding.kind for finding in findings}
        return _replaced(out, findings)
