"""Properties of the sensitive-data scanner over text as an attacker would write it: valid card
numbers, IBANs and keys, their characters parted by any run of separators (spaces and line breaks
of every kind, punctuation, dashes, bullets, invisible format characters), their digits in any
script, anywhere in other text, are redacted whole, exactly where they were; numbers failing
their checksum are not cards; and a scan stays linear in the text however hostile it is."""

from __future__ import annotations

import itertools
import time
import unicodedata
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from appliance.lookalikes import folded
from appliance.sensitive import IBAN_LENGTHS, Scanner, StreamRedactor, View, _few_cards, _many_cards, iban_ok, luhn_ok
from appliance.settings import ComplianceSettings
from serve.compliance import Compliance, Marks
from serve.errors import GatewayError

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
           "json escapes": "1\\n", "json digits": "\\u0031 ", "katakana gaps": "1\u30fc", "other letters": "12\u4e2d",
           "split prefixes": "A K I A ", "gitlab": "glpat-", "private keys": "-----BEGIN PRIVATE KEY-----",
           "curl": "curl -u a:", "slack": "xoxb-1234567890-", "jwt dots": "eyJ0eXAiOiJKV1Qi.", "hf": "hf_ "}


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


# Separators are decided by what they are not: between the digit groups of a card or the characters
# of an IBAN, anything a reader sees as neither a digit nor a Latin letter separates them (any
# length), and a gap of up to GAP characters as read may hold other scripts' letters and numbers
# (the katakana prolonged sound mark, modifier letters). Drawn from every general category.
CATEGORIES: list[Any] = ["Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nl", "No", "Pc", "Pd", "Ps", "Pe", "Pi",
                         "Pf", "Po", "Sm", "Sc", "Sk", "So", "Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co",
                         "Cn"]  # all but Nd: digits are digits


def _gap_char(char: str) -> bool:
    """Whether `char` is read as at most two characters, none a digit or a Latin letter."""
    seen = View.of(char).text
    return len(seen) <= 2 and not any(c.isascii() and c.isalnum() for c in seen)


GAP_CHARS = st.sampled_from(CATEGORIES).flatmap(lambda category: st.characters(categories=[category]).filter(_gap_char))
GAPS = st.text(GAP_CHARS, min_size=1, max_size=2)  # read as GAP characters at most
# An IBAN's detector reads a look-alike of a Latin letter or digit as that letter (a Cyrillic "В" as
# "B"), so one is no gap in an IBAN: it is one of its characters.
IBAN_GAPS = st.text(GAP_CHARS.filter(lambda char: folded(View.of(char).text) == View.of(char).text),
                    min_size=1, max_size=2)
COMPLIANCE = Compliance(ComplianceSettings())
POLICY = COMPLIANCE.policy(["user"])


@st.composite
def gapped(draw: st.DrawFn, characters: str, first: int = 1, gaps: st.SearchStrategy[str] = GAPS) -> str:
    """`characters` with gaps drawn from every category at some places (from `first` on)."""
    cuts = sorted(draw(st.sets(st.integers(first, len(characters) - 1), min_size=1, max_size=8)))
    out, last = [], 0
    for cut in cuts:
        out += [characters[last:cut], draw(gaps)]
        last = cut
    return "".join(out) + characters[last:]


def only_digits(text: str) -> str:
    return "".join(char for char in View.of(text).text if "0" <= char <= "9")


def latin_and_digits(text: str) -> str:
    return "".join(char for char in View.of(text).text if char.isascii() and char.isalnum()).upper()


def screened_everywhere(text: str, cuts: list[int]) -> tuple[str, str]:
    """`text` as a prompt (refused: GatewayError), then as a whole answer and as a streamed one cut
    at `cuts`: the two answers as the client gets them."""
    with pytest.raises(GatewayError) as refused:
        COMPLIANCE.screen_prompt({"messages": [{"role": "user", "content": text}]}, ("messages",), POLICY, Marks())
    assert refused.value.code == "sensitive_data"
    whole_filter = COMPLIANCE.answer_filter(POLICY, Marks())
    assert whole_filter is not None
    whole = whole_filter.answer({"choices": [{"index": 0, "message": {"content": text}}]})["choices"][0]
    stream = COMPLIANCE.answer_filter(POLICY, Marks())
    assert stream is not None
    bounds = [0, *sorted({cut % (len(text) + 1) for cut in cuts}), len(text)]
    streamed = ""
    for at, (start, end) in enumerate(itertools.pairwise(bounds)):
        event = {"choices": [{"index": 0, "delta": {"content": text[start:end]},
                              "finish_reason": "stop" if at == len(bounds) - 2 else None}]}
        streamed += stream.event(event)["choices"][0]["delta"].get("content", "")
    return whole["message"]["content"], streamed


@SETTINGS
@given(digits=luhn_numbers(), data=st.data(), before=WORDS, after=WORDS, cuts=st.lists(st.integers(0, 400)))
def test_a_card_with_gaps_of_any_category_is_caught_in_prompts_answers_and_streams(
        digits: str, data: st.DataObject, before: str, after: str, cuts: list[int]) -> None:
    text = f"{before} {data.draw(gapped(digits))} {after}"
    whole, streamed = screened_everywhere(text, cuts)
    assert digits not in only_digits(whole) and digits not in only_digits(streamed)
    assert streamed == whole


@SETTINGS
@given(iban=ibans(), data=st.data(), before=WORDS, after=WORDS, cuts=st.lists(st.integers(0, 400)))
def test_an_iban_with_gaps_of_any_category_is_caught_in_prompts_answers_and_streams(
        iban: str, data: st.DataObject, before: str, after: str, cuts: list[int]) -> None:
    text = f"{before} {data.draw(gapped(iban, first=2, gaps=IBAN_GAPS))} {after}"
    whole, streamed = screened_everywhere(text, cuts)
    assert iban[4:] not in latin_and_digits(whole) and iban[4:] not in latin_and_digits(streamed)
    assert streamed == whole


@SETTINGS
@given(placed(luhn_numbers(valid=False, sizes=(16, 16)), min_group=4), st.data())
def test_a_number_failing_luhn_with_gaps_of_any_category_is_no_card(case: tuple[str, str, int, int],
                                                                    data: st.DataObject) -> None:
    _, digits, _, _ = case
    groups = [digits[at:at + 4] for at in range(0, 16, 4)]
    text = "n " + "".join(group + data.draw(GAPS) for group in groups[:-1]) + groups[-1] + " ok"
    assert "payment_card" not in {f.kind for f in SCANNER.findings(text)}


@SETTINGS
@given(iban=ibans(), wrong=st.integers(1, 96), data=st.data())
def test_an_iban_failing_mod_97_with_gaps_of_any_category_is_no_iban(iban: str, wrong: int,
                                                                     data: st.DataObject) -> None:
    check = (int(iban[2:4]) + wrong) % 100
    bad = f"{iban[:2]}{check:02d}{iban[4:]}"
    assume(not iban_ok(bad))
    text = f"to {data.draw(gapped(bad, first=2, gaps=IBAN_GAPS))} ok"
    assert "iban" not in {f.kind for f in SCANNER.findings(text, {"iban"})}


@pytest.mark.parametrize("gap", ["ーーーーー", "ʹʹʹʹʹ", "中文中文中", " x ", "x", "ab"])
def test_a_long_gap_of_other_letters_or_any_latin_letter_parts_a_number(gap: str) -> None:
    """Ten digits and nine digits with such a gap between are two numbers, neither long enough."""
    number = next(f"411111111111111111{check}" for check in range(10) if luhn_ok(f"411111111111111111{check}"))
    text = f"ref {number[:10]}{gap}{number[10:]} ok"  # together, 19 digits passing Luhn
    assert not SCANNER.findings(text, {"payment_card"})
    assert SCANNER.findings(text.replace(gap, "ー"), {"payment_card"})


ORDINARY = [
    "The meeting moved to 14:30 on 2024-05-17; room 1204, building 3.",
    "2024年12月31日10時30分、会議室3で。価格は1,234円と5,678円です。",
    "commit 9fceb02d0ae598e95dc970b74767f19372d61af8 and e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b785",
    "def area(r: float) -> float:\n    return 3.14159 * r ** 2  # see issue tracker\n",
    "SELECT id, total FROM orders WHERE total > 100 AND created_at > '2024-01-01' LIMIT 50;",
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==",
    "Version 3.12.1 fixed 7 bugs; see https://example.org/releases/3.12.1#notes for the list.",
    "Ask your key holder; a risky skill, the sky-blue AKIRA poster, hf is a unit, the glpat- prefix.",
    "Привет! Встреча в 10:30, кабинет 215. Телефон не нужен.",
]


@pytest.mark.parametrize("text", ORDINARY)
def test_ordinary_prose_and_code_hold_no_card_iban_or_secret(text: str) -> None:
    assert not [f for f in SCANNER.findings(text) if f.kind in {"payment_card", "iban", "secret"}]
