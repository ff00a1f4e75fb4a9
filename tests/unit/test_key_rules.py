"""The vendored key rules (appliance.key_rules, appliance.key_shapes): every kept rule compiles with
every repetition bounded and finds an example made from its own regex, also with its prefix split
by spaces; the file is the pinned one; the rules left out are the ones said; and a hostile text
full of every rule's keywords costs the rules a bounded count of characters scanned."""

from __future__ import annotations

import itertools
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import regex

from appliance import key_rules, key_shapes
from appliance.errors import SettingsError
from appliance.key_rules import ASSIGNMENT, MOST, SKIPPED, Rule, bounded, entropy, rules
from appliance.sensitive import Scanner, StreamRedactor

SCANNER = Scanner()
RULES = {rule.id: rule for rule in rules()}
parser: Any = getattr(re, "_parser")  # noqa: B009 (private, and typeshed does not list it)
constants: Any = getattr(re, "_constants")  # noqa: B009
# Characters an example is made of, in the order a set's members are taken (round robin: varied
# enough for the rules' entropy thresholds).
POOL = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-_./+=~ "


def _in_set(items: list[tuple[Any, Any]], char: str) -> bool:
    inside = False
    for op, value in items:
        if op is constants.NEGATE:
            continue
        if op is constants.LITERAL:
            inside |= ord(char) == value
        elif op is constants.RANGE:
            inside |= value[0] <= ord(char) <= value[1]
        elif op is constants.CATEGORY:
            name = str(value).rsplit("_", 1)[-1]
            holds = {"DIGIT": char.isdigit(), "SPACE": char.isspace(), "WORD": char.isalnum() or char == "_"}[name]
            inside |= holds != ("NOT" in str(value))
    negated = bool(items) and items[0][0] is constants.NEGATE
    return inside != negated


class _Example:
    """A text a regex (Python's `re` syntax) matches: the first branch of each alternation, the
    fewest repeats, set members taken in turn from POOL."""

    def __init__(self) -> None:
        self.turn = itertools.count()

    def of(self, nodes: Any) -> str:
        return "".join(self.node(op, value) for op, value in nodes)

    def pick(self, members: list[str]) -> str:
        return members[next(self.turn) % len(members)]

    def node(self, op: Any, value: Any) -> str:
        if op is constants.LITERAL:
            return chr(value)
        if op is constants.NOT_LITERAL:
            return self.pick([c for c in POOL if ord(c) != value])
        if op is constants.ANY:
            return "."  # the rules write a domain's dots unescaped ("hooks.slack.com")
        if op is constants.IN:
            return self.pick([c for c in POOL if _in_set(value, c)])
        if op is constants.BRANCH:
            return self.of(value[1][0])
        if op is constants.SUBPATTERN:
            return self.of(value[-1])
        if op in (constants.MAX_REPEAT, constants.MIN_REPEAT, getattr(constants, "POSSESSIVE_REPEAT", None)):
            return "".join(self.of(value[2]) for _ in range(value[0]))
        return ""  # anchors and look-arounds: the text around the example supplies them


def as_python_re(pattern: str) -> str:
    """A rule's pattern in `re` syntax for making examples: inline flags dropped (case-insensitivity
    only widens what matches) and POSIX classes spelled out."""
    return pattern.replace("(?i)", "").replace("[:alnum:]", "a-zA-Z0-9")


def example(rule: Rule) -> str:
    made = _Example().of(parser.parse(as_python_re(rule.pattern.pattern)))
    assert rule.pattern.search(f"token: {made} end") is not None, (rule.id, made)  # the maker is right
    return made


def secret_of(rule: Rule, text: str) -> str:
    match = rule.pattern.search(text)
    assert match is not None
    group = rule.group or next((i for i in range(1, len(match.groups()) + 1) if match.group(i)), 0)
    return match.group(group)


@pytest.mark.parametrize("rule", list(RULES.values()), ids=list(RULES))
def test_every_kept_rule_is_bounded_and_finds_its_own_example(rule: Rule) -> None:
    assert bounded(rule.pattern.pattern) == rule.pattern.pattern  # no unbounded repetition is left
    text = f"token: {example(rule)} end"
    secret = secret_of(rule, text)
    assert entropy(secret) >= rule.entropy
    assert not rule.led or any(example(rule).lower().startswith(keyword) for keyword in rule.keywords)
    found = [f for f in SCANNER.findings(text) if f.kind == "secret"]
    assert found and any(f.start <= text.index(secret) and text.index(secret) + len(secret) <= f.end for f in found)
    assert secret not in SCANNER.redact(text)


@pytest.mark.parametrize("rule", list(RULES.values()), ids=list(RULES))
def test_every_kept_rule_finds_its_example_streamed_in_pieces(rule: Rule) -> None:
    text = f"token: {example(rule)} end"
    secret = secret_of(rule, text)
    for size in (1, 3, 7):
        stream, out = StreamRedactor(SCANNER, {"secret"}, 8192), ""
        for at in range(0, len(text), size):
            out += stream.feed(text[at:at + size])
        assert secret not in out + stream.flush(), size


def _split_prefixes() -> Iterator[tuple[str, str, int]]:
    """(rule, its example, where a space goes) for each rule whose example starts with one of its
    keywords (three characters or more), at each place inside that keyword."""
    for rule in RULES.values():
        made = example(rule)
        keyword = next((k for k in rule.keywords if len(k) >= 3 and made.lower().startswith(k)), None)
        if keyword is not None:
            yield from ((rule.id, made, cut) for cut in range(1, len(keyword)))


SPLIT = list(_split_prefixes())


@pytest.mark.parametrize(("rule_id", "made", "cut"), SPLIT, ids=[f"{r}@{c}" for r, _, c in SPLIT])
def test_a_rules_prefix_split_by_spaces_is_read_joined(rule_id: str, made: str, cut: int) -> None:
    rule = RULES[rule_id]
    rest = secret_of(rule, f"token: {made} end")[cut:]
    for space in (" ", " \n ", "\u2003"):
        text = f"token: {made[:cut]}{space}{made[cut:]} end"
        assert "secret" in {f.kind for f in SCANNER.findings(text)}, (space, text)
        assert rest not in SCANNER.redact(text)


@pytest.mark.parametrize(("written", "key"), [
    ("sk - abcdefghijklmnopqrstuvwxyz12", "abcdefghijklmnopqrstuvwxyz12"),
    ("AKI AABCDEFGHIJKLMNOP", "ABCDEFGHIJKLMNOP"), ("A K I A ABCDEFGHIJKLMNOP", "ABCDEFGHIJKLMNOP"),
    ("gh p_" + "a1B2" * 9, "a1B2" * 9),
    ("xox b-1234567890abc", "1234567890abc"), ("github _pat_11ABCDEFG0123456789abcdef_xyz", "0123456789abcdef")])
def test_our_own_prefixes_split_by_spaces_are_read_joined(written: str, key: str) -> None:
    assert SCANNER.redact(f"my key: {written} end") == "my key: [SECRET] end"
    stream, out = StreamRedactor(SCANNER, {"secret"}, 256), ""
    for char in f"my key: {written} end":
        out += stream.feed(char)
    assert key not in out + stream.flush()


def test_words_that_only_look_like_split_prefixes_stay() -> None:
    for text in ("I like sk - it is fine", "Ask Kim about the AKI A team", "risk - assessment", "as k8s said",
                 "the gl pat - on the back", "a kia car", "use hf _ as a name"):
        assert SCANNER.redact(text) == text


def test_the_rules_left_out_are_those_said() -> None:
    import tomllib

    every = tomllib.loads(key_rules.RULES_FILE.read_text())["rules"]
    left_out = {rule["id"] for rule in every} - set(RULES)
    for rule in every:
        if rule["id"] in left_out:
            assert (rule["id"] in SKIPPED or "path" in rule or not rule.get("regex")
                    or ASSIGNMENT in rule["regex"]), rule["id"]
    assert {"aws-access-token", "stripe-access-token", "gitlab-pat", "huggingface-access-token", "gcp-api-key",
            "private-key", "github-pat", "slack-bot-token", "openai-api-key", "anthropic-api-key"} <= set(RULES)
    assert "generic-api-key" in left_out


def test_a_rules_file_that_is_not_the_pinned_one_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    changed = tmp_path / "gitleaks.toml"
    shutil.copy(key_rules.RULES_FILE, changed)
    changed.write_text(changed.read_text().replace("AKIA", "AKIB"))
    monkeypatch.setattr(key_rules, "RULES_FILE", changed)
    key_rules.rules.cache_clear()
    try:
        with pytest.raises(SettingsError, match="SHA-256"):
            key_rules.rules()
    finally:
        monkeypatch.undo()
        key_rules.rules.cache_clear()
    assert len(key_rules.rules()) == len(RULES)


@pytest.mark.parametrize(("pattern", "expected"), [
    (r"a*b+?c{3,}", rf"a{{0,{MOST}}}b{{1,{MOST}}}?c{{3,{MOST}}}"), (r"[*+]{2}\z", r"[*+]{2}\Z"),
    (r"[[:alnum:]]+", rf"[[:alnum:]]{{1,{MOST}}}"), (r"[]*]\*", r"[]*]\*"), (r"x{9000,}", "x{9000,9000}")])
def test_unbounded_repetitions_are_bounded_and_nothing_else_changes(pattern: str, expected: str) -> None:
    assert bounded(pattern) == expected
    regex.compile(bounded(pattern), regex.V1)


class _Counting:
    """A compiled pattern that counts the characters it is asked to scan."""

    def __init__(self, pattern: regex.Pattern[str], tally: list[int]) -> None:
        self.pattern, self.tally = pattern, tally

    def finditer(self, text: str, pos: int = 0, **kw: Any) -> Iterator[regex.Match[str]]:
        self.tally[0] += len(text) - pos
        return self.pattern.finditer(text, pos, **kw)

    def fullmatch(self, text: str, pos: int = 0, **kw: Any) -> regex.Match[str] | None:
        self.tally[0] += len(text) - pos
        return self.pattern.fullmatch(text, pos, **kw)


def test_a_hostile_text_of_every_keyword_costs_the_rules_bounded_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """64 KiB of every rule's keywords and examples, run together and split by spaces: each rule's
    pattern (every repetition bounded, so each start costs at most a bounded number of steps) is
    asked to scan a count of characters bounded by the text's length, not its square."""
    units = [keyword for rule in RULES.values() for keyword in rule.keywords] + [example(r) for r in RULES.values()]
    unit = " ".join(units) + " " + "".join(units)
    text = (unit * (65536 // len(unit) + 1))[:65536]
    tally = [0]
    unled = key_shapes.unled_shape()
    counted = tuple(Rule(r.id, _Counting(r.pattern, tally), r.keywords, r.entropy, r.group)  # type: ignore[arg-type]
                    for r in RULES.values())
    monkeypatch.setattr(key_shapes, "rules", lambda: counted)
    monkeypatch.setattr(key_shapes, "unled_shape", lambda: _Counting(unled, tally))
    found = SCANNER._all(text, (frozenset({"secret"}),))
    assert found
    assert tally[0] <= len(RULES) * len(text)  # each rule scans the text once at most
    tally[0] = 0
    key_shapes.SecretDetector().pending(text)  # as a stream's held text: the shapes not led by a keyword at
    assert tally[0] <= (len(RULES) + 2) * len(text)  # once, and the rules whose keywords it holds, in part


@pytest.mark.parametrize("size", [1, 5, 64, 300])
@pytest.mark.parametrize("escaped", [False, True])
def test_a_private_key_longer_than_a_stream_may_hold_is_dropped_to_its_end(size: int, escaped: bool) -> None:
    body = "".join(chr(ord("A") + (at * 7) % 26) + "abc+/019"[at % 8] for at in range(1600))  # 3200 characters
    pem = "-----BEGIN RSA PRIVATE KEY-----\n" + "\n".join(body[at:at + 64] for at in range(0, len(body), 64))
    text = f"here:\n{pem}\n-----END RSA PRIVATE KEY-----\nthanks"
    if escaped:  # as a tool call's arguments write it
        text = text.replace("\n", "\\n")
    stream, out = StreamRedactor(SCANNER, {"secret"}, 256), ""
    for at in range(0, len(text), size):
        out += stream.feed(text[at:at + size])
    out += stream.flush()
    assert out == SCANNER.redact(text, {"secret"}) == text[:text.index("-----BEGIN")] + "[SECRET]" + text[
        text.index("KEY-----", text.index("-----END")) + 8:]


def test_a_private_keys_end_split_between_the_held_text_and_the_next_piece_ends_it() -> None:
    body = "".join(chr(ord("A") + (at * 5) % 26) for at in range(300))
    text = f"k: -----BEGIN PRIVATE KEY-----\n{body}\n-----END PRIVATE KEY-----\nafter"
    split = text.index("KEY-----", 40) + 4
    stream = StreamRedactor(SCANNER, {"secret"}, 256)
    assert stream.feed(text[:split]) + stream.feed(text[split:]) + stream.flush() == "k: [SECRET]\nafter"
