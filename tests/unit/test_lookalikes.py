"""Look-alike letters of other scripts in keys and IBANs (appliance.lookalikes): the fold is one
character for one, to ASCII letters and digits only, from Unicode's confusables; every vendored
rule's example and every valid IBAN with any of its ASCII letters written as look-alikes is still
caught, whole and streamed, its original characters redacted; the card detector does not fold;
and ordinary Cyrillic and Greek prose holds no finding."""

from __future__ import annotations

import itertools
import unicodedata

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.key_rules import Rule, rules
from appliance.lookalikes import SHORT, folded, table
from appliance.sensitive import Scanner, StreamRedactor, View
from tests.unit.test_key_rules import example, secret_of
from tests.unit.test_sensitive_properties import SETTINGS, WORDS, ibans, latin_and_digits, screened_everywhere

SCANNER = Scanner()
RULES = {rule.id: rule for rule in rules()}
# Each ASCII letter's look-alikes, as the view leaves them (so as the detectors are given them).
LOOKALIKES: dict[str, list[str]] = {}
for _code, _ascii in sorted(table().items()):
    if View.of(chr(_code)).text == chr(_code):
        LOOKALIKES.setdefault(_ascii, []).append(chr(_code))


def test_the_fold_is_one_letter_or_number_for_one_ascii_letter_or_digit() -> None:
    assert len(table()) > 300
    for code, ascii_char in table().items():
        char = chr(code)
        assert not char.isascii() and unicodedata.category(char)[0] in "LN", char
        assert len(ascii_char) == 1 and ascii_char.isascii() and ascii_char.isalnum(), char
    assert folded("ѕк-АКIА GВ82 Ӏ ӏ і ο ρ") == "sk-AKIA GB82 I i i o p"  # a capital to a capital, a small to a small
    assert folded("∣ǃ ー 中 я ∂") == "∣ǃ ー 中 я ∂"  # symbols stay separators; letters that imitate none stay
    assert folded("٤٥ ০") == "٤٥ ০"  # digits are read by value by the view, not by their looks


@pytest.mark.parametrize(("text", "redacted"), [
    ("key ѕк-abcdefghijklmnopqrstuvwxyz123 ok", "key [SECRET] ok"),
    ("id АКIАABCDEFGHIJKLMNOP ok", "id [SECRET] ok"),
    ("to GВ82 WEST 1234 5698 7654 32 ok", "to [IBAN] ok"),
])
def test_the_look_alikes_review_found_are_caught_everywhere(text: str, redacted: str) -> None:
    assert SCANNER.redact(text) == redacted
    for cuts in ([], list(range(len(text))), [5, 6, 9, 17]):
        whole, streamed = screened_everywhere(text, cuts)  # the prompt is refused
        assert whole == streamed == redacted


def _disguised(text: str, picks: list[int]) -> str:
    """`text` with its ASCII letters at the positions picked (taken modulo the letters there are)
    written as look-alikes (the look-alike taken by the same pick)."""
    letters = [at for at, char in enumerate(text) if char in LOOKALIKES]
    out = list(text)
    for pick in picks:
        if letters:
            at = letters[pick % len(letters)]
            out[at] = LOOKALIKES[text[at]][pick % len(LOOKALIKES[text[at]])]
    return "".join(out)


def _every_letter(text: str) -> str:
    return "".join(LOOKALIKES[char][0] if char in LOOKALIKES else char for char in text)


def _caught(rule: Rule, made: str, shown: str, cuts: list[int]) -> None:
    """The example `made`, written as `shown`, is a secret, its key gone from the text whole and
    streamed (read back as the key detector reads it), and only its own characters are replaced."""
    secret = folded(secret_of(rule, f"token: {made} end"))
    text = f"token: {shown} end"
    assert "secret" in {finding.kind for finding in SCANNER.findings(text)}, (rule.id, text)
    redacted = SCANNER.redact(text, {"secret"})
    assert secret not in folded(View.of(redacted).text) and redacted.startswith("token: ")
    bounds = [0, *sorted({cut % (len(text) + 1) for cut in cuts}), len(text)]
    stream = StreamRedactor(SCANNER, {"secret"}, 8192)
    out = "".join(stream.feed(text[start:end]) for start, end in itertools.pairwise(bounds)) + stream.flush()
    assert secret not in folded(View.of(out).text), (rule.id, text, cuts)


@pytest.mark.parametrize("rule", list(RULES.values()), ids=list(RULES))
def test_every_rules_example_with_every_letter_a_look_alike_is_caught(rule: Rule) -> None:
    made = example(rule)
    for size in (1, 3, 7):
        _caught(rule, made, _every_letter(made), list(range(0, len(made) + 20, size)))


@SETTINGS
@given(rule=st.sampled_from(list(RULES.values())), picks=st.lists(st.integers(0, 10_000), max_size=12),
       cuts=st.lists(st.integers(0, 400), max_size=12))
def test_any_rules_example_with_any_letters_look_alikes_is_caught(rule: Rule, picks: list[int],
                                                                  cuts: list[int]) -> None:
    made = example(rule)
    _caught(rule, made, _disguised(made, picks), cuts)


@SETTINGS
@given(iban=ibans(), picks=st.lists(st.integers(0, 10_000), max_size=12), grouped=st.booleans(),
       before=WORDS, after=WORDS, cuts=st.lists(st.integers(0, 400)))
def test_a_valid_iban_with_any_letters_look_alikes_is_caught_everywhere(
        iban: str, picks: list[int], grouped: bool, before: str, after: str, cuts: list[int]) -> None:
    shown = _disguised(iban, picks)
    if grouped:
        shown = " ".join(shown[at:at + 4] for at in range(0, len(shown), 4))
    text = f"{before} {shown} {after}"
    found = [finding for finding in SCANNER.findings(text) if finding.kind == "iban"]
    assert [text[finding.start:finding.end] for finding in found] == [shown]  # its own characters, no more
    whole, streamed = screened_everywhere(text, cuts)
    assert iban[4:] not in latin_and_digits(folded(View.of(whole).text))
    assert iban[4:] not in latin_and_digits(folded(View.of(streamed).text))
    assert streamed == whole


def test_the_card_detector_reads_no_look_alikes() -> None:
    """Another script's letters in a short gap part a card's groups as separators, look-alikes too."""
    text = "card 4111о1111о1111о1111 ok"  # Cyrillic o between the groups
    assert SCANNER.redact(text, {"payment_card"}) == "card [PAYMENT_CARD] ok"


PROSE = [
    "Москва — столица России, крупнейший по численности населения город страны.",
    "Секретный ключ хранится в сейфе, а копия — у бухгалтера Ивановой.",
    "Собрание акционеров ОАО «Газпром» состоится в большом зале; вход по пропускам.",
    "КОД ОШИБКИ ЕКСЕРТ: ОБРАТИТЕСЬ В СЛУЖБУ ПОДДЕРЖКИ.",
    "Київ — столиця України, розташований на річці Дніпро.",
    "Η Αθήνα είναι η πρωτεύουσα της Ελλάδας και η μεγαλύτερη πόλη της χώρας.",
    "Ο Σωκράτης ήταν Έλληνας φιλόσοφος από την Αθήνα, ένας από τους ιδρυτές της δυτικής φιλοσοφίας.",
    "ΑΚΡΟΠΟΛΗ ΑΘΗΝΩΝ — ΩΡΑΡΙΟ ΛΕΙΤΟΥΡΓΙΑΣ ΚΑΘΗΜΕΡΙΝΑ, ΕΚΤΟΣ ΑΠΟ ΤΙΣ ΑΡΓΙΕΣ.",
]


@pytest.mark.parametrize("text", PROSE)
def test_ordinary_cyrillic_and_greek_prose_holds_no_finding(text: str) -> None:
    assert SCANNER.findings(text) == []
    stream = StreamRedactor(SCANNER, SCANNER.kinds, 256)
    assert "".join(stream.feed(char) for char in text) + stream.flush() == text


@SETTINGS
@given(text=st.text(st.one_of(st.sampled_from(sorted({c for chars in LOOKALIKES.values() for c in chars})),
                              st.characters()), min_size=SHORT + 1, max_size=600))
def test_a_long_text_is_folded_as_a_short_one_is(text: str) -> None:
    """Texts past SHORT are folded by numpy; each character as `str.translate` folds it alone."""
    assert folded(text) == "".join(folded(char) for char in text)
    assert folded("\ud800" * SHORT + "ѕ") == "\ud800" * SHORT + "s"  # a lone surrogate (a JSON escape's) stays
