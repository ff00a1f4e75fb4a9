"""A scan for sensitive data in training text: e-mail addresses, phone numbers, payment card
numbers (Luhn-checked), IBANs (mod-97-checked), API-key-like secrets, and patterns the operator
adds. Findings name the line and the kind, never the matched text (it is what must not leak)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

EMAIL = re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}\b")
PHONE = re.compile(r"(?<![\w+])\+?\d[\d ()./-]{7,}\d(?!\w)")
CARD = re.compile(r"(?<!\d)(?:\d[ -]?){12,18}\d(?!\d)")
IBAN = re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]){11,30}\b")
SECRET = re.compile(r"\b(?:sk-[A-Za-z0-9_-]{20,}|AKIA[0-9A-Z]{16}|gh[pousr]_[A-Za-z0-9]{36,}"
                    r"|xox[abpr]-[A-Za-z0-9-]{10,}"
                    r"|eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,})\b")


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


def _card(match: str) -> bool:
    digits = re.sub(r"\D", "", match)
    return 13 <= len(digits) <= 19 and luhn_ok(digits)


def _phone(match: str) -> bool:
    digits = re.sub(r"\D", "", match)
    return 9 <= len(digits) <= 15 and not _card(match)


@dataclass(frozen=True)
class Detector:
    kind: str
    pattern: re.Pattern[str]
    confirm: Callable[[str], bool] = lambda match: True


DETECTORS = (Detector("email", EMAIL), Detector("payment_card", CARD, _card), Detector("iban", IBAN, iban_ok),
             Detector("secret", SECRET), Detector("phone", PHONE, _phone))


@dataclass(frozen=True)
class Finding:
    line: int
    kind: str


class Scanner:
    """Finds and redacts sensitive spans; `extra` adds named operator patterns."""

    def __init__(self, extra: dict[str, str] | None = None) -> None:
        self.detectors = DETECTORS + tuple(Detector(kind, re.compile(pattern))
                                           for kind, pattern in (extra or {}).items())

    def spans(self, text: str) -> list[tuple[int, int, str]]:
        """(start, end, kind) of every confirmed finding, earlier detectors winning overlaps."""
        taken: list[tuple[int, int, str]] = []
        for detector in self.detectors:
            for match in detector.pattern.finditer(text):
                start, end = match.span()
                if detector.confirm(match.group()) and not any(s < end and start < e for s, e, _ in taken):
                    taken.append((start, end, detector.kind))
        return sorted(taken)

    def redact(self, text: str) -> str:
        for start, end, kind in reversed(self.spans(text)):
            text = f"{text[:start]}[{kind.upper()}]{text[end:]}"
        return text
