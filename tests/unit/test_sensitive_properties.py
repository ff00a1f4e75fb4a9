"""Properties of the sensitive-data scanner over text as an attacker would write it: valid card
numbers, IBANs and keys, their characters parted by any run of separators (spaces and line breaks
of every kind, punctuation, dashes, bullets, invisible format characters), their digits in any
script, anywhere in other text, are redacted whole, exactly where they were; numbers failing
their checksum are not cards; and a scan stays linear in the text however hostile it is."""

from __future__ import annotations

import time
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.sensitive import IBAN_LENGTHS, Scanner, StreamRedactor, View, _few_cards, _many_cards, iban_ok, luhn_ok

SCANNER = Scanner()
# max_examples from the profile tests/conftest.py loads: 150 in a full run, fewer in the fast loop.
SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Zero of each script whose digits a reader reads as 0-9.
ZEROS = [0x30, 0x660, 0x6F0, 0x966, 0x9E6, 0xA66, 0xE50, 0xFF10, 0x1D7CE, 0x1D7EC]


def _separating(char: str) -> bool:
    """Whether a reader sees `char` as no letter or digit (a separator, or nothing at all)."""
    return not any(part.isalnum() for part in unicodedata.normalize("NFKC", char))


SEPARATOR_CHARS = st.characters(categories=["Zs", "Zl", "Zp", "Pd", "Po", "Ps", "Pe", "Pc", "Pi", "Pf", "Cf", "Sm",
                                            "So", "Mn", "Cc"]).filter(_separating)
INVISIBLE_CHARS = st.sampled_from(["\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\u00ad", "\ufe0f", "\u180e"])
VISIBLE_SEPARATOR = st.sampled_from([" ", "\n", "\t", ", ", " - ", "\u2013", "\u2014", "\u2022 ", ": ", "\u3000",
                                     "\u00a0", "/", "."])
SEPARATORS = st.text(SEPARATOR_CHARS, min_size=0, max_size=4)
# Text around a number: words and punctuation, no digits (it is checked apart from its digits).
WORDS = st.text(st.characters(categories=["Lu", "Ll", "Lo", "Zs", "Po"]).filter(
    lambda c: not any(p.isdigit() for p in unicodedata.normalize("NFKC", c))), max_size=30)


def digit_in(script: int, value: int) -> str:
    return chr(script + value)


@st.composite
def luhn_numbers(draw: st.DrawFn, valid: bool = True, sizes: tuple[int, int] = (13, 19)) -> str:
    body = draw(st.lists(st.integers(0, 9), min_size=sizes[0] - 1, max_size=sizes[1] - 1))
    for check in range(10):
        number = "".join(map(str, [*body, check]))
        if luhn_ok(number) == valid:
            return number
    raise AssertionError("unreachable")


@st.composite
def written(draw: st.DrawFn, characters: str, min_group: int = 1) -> str:
    """`characters` as an attacker writes them: digits in any scripts, separators between any of
    them (groups of at least `min_group`)."""
    out = []
    since = 0
    for position, char in enumerate(characters):
        if position and since >= min_group and len(characters) - position >= min_group and draw(st.booleans()):
            out.append(draw(st.one_of(SEPARATORS, VISIBLE_SEPARATOR)))
            since = 0
        out.append(digit_in(draw(st.sampled_from(ZEROS)), int(char)) if char.isdigit() else char)
        since += 1
    return "".join(out)


def read_digits(text: str) -> str:
    """The digits a reader sees, letters kept as breaks (a marker "[PAYMENT_CARD]" parts them)."""
    return "".join(char for char in View.of(text).text if char.isalnum())


@st.composite
def placed(draw: st.DrawFn, number: st.SearchStrategy[str], min_group: int = 1) -> tuple[str, str, int, int]:
    """A number written somehow between words (a visible separator on each side): the text, the
    number's characters, and where it was written."""
    characters = draw(number)
    shown = draw(written(characters, min_group))
    before = draw(WORDS) + draw(VISIBLE_SEPARATOR)
    after = draw(VISIBLE_SEPARATOR) + draw(WORDS)
    return before + shown + after, characters, len(before), len(before) + len(shown)


def _ends_trimmed(text: str, start: int, end: int) -> tuple[int, int]:
    """[start, end) without the invisible characters at its ends (they are no part of a finding)."""
    while start < end and not View.of(text[start]).text:
        start += 1
    while end > start and not View.of(text[end - 1]).text:
        end -= 1
    return start, end


@SETTINGS
@given(placed(luhn_numbers()))
def test_a_valid_card_however_written_is_found_exactly_and_redacted(case: tuple[str, str, int, int]) -> None:
    text, digits, start, end = case
    cards = [f for f in SCANNER.findings(text) if f.kind == "payment_card"]
    assert [(f.start, f.end) for f in cards] == [_ends_trimmed(text, start, end)]
    redacted = SCANNER.redact(text)
    assert digits not in read_digits(redacted)
    assert redacted == text[:cards[0].start] + "[PAYMENT_CARD]" + text[cards[0].end:]  # nothing else changed


@SETTINGS
@given(placed(luhn_numbers(valid=False, sizes=(16, 16)), min_group=4))  # no part of it has 13 digits
def test_a_number_failing_the_luhn_check_is_no_card(case: tuple[str, str, int, int]) -> None:
    text, _, _, _ = case
    assert "payment_card" not in {f.kind for f in SCANNER.findings(text)}


@SETTINGS
@given(short=st.lists(st.text("0123456789", min_size=1, max_size=3), min_size=1, max_size=8),
       card=luhn_numbers(), separator=st.one_of(SEPARATORS, VISIBLE_SEPARATOR).filter(lambda s: View.of(s).text),
       words=WORDS)
def test_a_card_after_short_digit_groups_is_redacted(short: list[str], card: str, separator: str, words: str) -> None:
    text = f"{words} {separator.join(short)}{separator}{card} {words}"
    redacted = SCANNER.redact(text, {"payment_card"})
    assert card not in read_digits(redacted)
    kept = redacted.split("[PAYMENT_CARD]")
    assert len(kept) >= 2 and text.startswith(kept[0]) and text.endswith(kept[-1])


@st.composite
def ibans(draw: st.DrawFn) -> str:
    country = draw(st.sampled_from(sorted(IBAN_LENGTHS)))
    bban = draw(st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", min_size=IBAN_LENGTHS[country] - 4,
                        max_size=IBAN_LENGTHS[country] - 4))
    moved = (bban + country + "00").translate({ord(c): str(int(c, 36)) for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ"})
    iban = f"{country}{98 - int(moved) % 97:02d}{bban}"
    assert iban_ok(iban)
    return iban


@st.composite
def written_iban(draw: st.DrawFn) -> tuple[str, str]:
    iban = draw(ibans())
    code = iban[:2].lower() if draw(st.booleans()) else iban[:2]
    if draw(st.booleans()):  # full-width
        code = "".join(chr(ord(c) - ord("A") + 0xFF21) if c.isupper() else chr(ord(c) - ord("a") + 0xFF41)
                       for c in code)
    return code + draw(written(iban[2:])), iban


@SETTINGS
@given(case=written_iban(), before=WORDS, after=WORDS)
def test_a_valid_iban_however_written_is_redacted_exactly(case: tuple[str, str], before: str, after: str) -> None:
    shown, iban = case
    text = f"{before} {shown} {after}"
    found = [f for f in SCANNER.findings(text) if f.kind == "iban"]
    assert [(f.start, f.end) for f in found] == [_ends_trimmed(text, len(before) + 1, len(before) + 1 + len(shown))]
    assert iban[4:].upper() not in read_digits(SCANNER.redact(text)).upper()


KEYS = {"AKIA": ("AKIA", "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", 16), "sk-": ("sk-", "abcXYZ0123456789_", 20),
        "ghp_": ("ghp_", "abcXYZ0123456789", 36), "xoxb-": ("xoxb-", "abcXYZ0123456789", 10)}


@st.composite
def split_keys(draw: st.DrawFn) -> tuple[str, str]:
    prefix, alphabet, least = KEYS[draw(st.sampled_from(sorted(KEYS)))]
    body = draw(st.text(alphabet, min_size=least, max_size=least))
    cuts = draw(st.lists(st.tuples(st.integers(1, least - 1), st.one_of(INVISIBLE_CHARS, st.just(" "))), max_size=3))
    shown = body
    for at, char in sorted(cuts, reverse=True):
        shown = shown[:at] + char + shown[at:]
    return prefix + shown, prefix + body


@SETTINGS
@given(case=split_keys(), before=WORDS, after=WORDS)
def test_a_key_split_by_spaces_or_invisible_characters_is_a_secret(case: tuple[str, str], before: str,
                                                                     after: str) -> None:
    shown, key = case
    text = f"{before} {shown} {after}"
    assert key not in View.of(SCANNER.redact(text)).text.replace(" ", "")
    assert "secret" in {f.kind for f in SCANNER.findings(text)}


@SETTINGS
@given(st.text(max_size=200))
def test_any_text_maps_back_exactly(text: str) -> None:
    """Redaction changes only the findings' spans, each starting and ending on what a reader sees."""
    findings = SCANNER.findings(text)
    rebuilt, at = "", 0
    for finding in findings:
        assert at <= finding.start < finding.end <= len(text)
        assert View.of(text[finding.start]).text and View.of(text[finding.end - 1]).text
        rebuilt += text[at:finding.start] + f"[{finding.kind.upper()}]"
        at = finding.end
    assert SCANNER.redact(text) == rebuilt + text[at:]


# Each hostile class scanned at two sizes: a linear scan takes about ten times as long for ten
# times the text (a generous bound, not a clock threshold: a quadratic one would take a hundred).
HOSTILE = {"card groups": "4111 ", "ones and spaces": "1 ", "ones and dashes": "1-", "ones and commas": "1,",
           "digits": "1", "email": "a.", "mixed scripts": "\u0661\u0967\uff11 \u200b", "zero-width": "1\u200b",
           "iban groups": "GB82 ", "sk keys": "_sk-", "jwt": "eyJ-", "akia": "AKIA ", "phones": "+1 415 555 2671 ",
           "json escapes": "1\\n", "json digits": "\\u0031 "}


def _scan_seconds(text: str) -> float:
    best = float("inf")
    for _ in range(3):
        started = time.process_time()
        SCANNER.findings(text)
        best = min(best, time.process_time() - started)
    return best


@pytest.mark.parametrize("unit", list(HOSTILE.values()), ids=list(HOSTILE))
def test_a_hostile_text_scans_in_linear_time(unit: str) -> None:
    small, large = (("a@" if unit == "a." else "") + unit * (size // len(unit)) for size in (20_000, 200_000))
    assert _scan_seconds(large) < 40 * max(_scan_seconds(small), 0.002)


@SETTINGS
@given(case=placed(luhn_numbers()), cuts=st.lists(st.integers(1, 9), min_size=1, max_size=40))
def test_a_streamed_card_is_redacted_as_the_whole_text_is_however_it_is_cut(case: tuple[str, str, int, int],
                                                                            cuts: list[int]) -> None:
    text = case[0]
    stream, out, at = StreamRedactor(SCANNER, {"payment_card"}, 256), "", 0
    for step in cuts * (len(text) // sum(cuts) + 1):
        if at >= len(text):
            break
        out += stream.feed(text[at:at + step])
        at += step
    assert out + stream.flush() == SCANNER.redact(text, {"payment_card"})


@SETTINGS
@given(st.lists(st.one_of(luhn_numbers(), st.text("0123456789", min_size=1, max_size=6), WORDS,
                          st.one_of(SEPARATORS, VISIBLE_SEPARATOR)), max_size=40))
def test_few_digit_groups_are_checked_as_many_are(parts: list[str]) -> None:
    text = View.of("".join(parts)).text
    assert _few_cards(text) == list(_many_cards(text))
