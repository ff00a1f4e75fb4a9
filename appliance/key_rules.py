"""Providers' key shapes from a maintained rule set: gitleaks' default rules, vendored unchanged
and pinned in `appliance/rules/` (version, source and SHA-256 in its README), loaded once.

Each rule's regex is Go RE2 syntax; the `regex` package reads it as written in its version 1 mode
(inline flags scoped to their group, as in Go), once `\\z` is spelled `\\Z` and every unbounded
repetition is given a bound (`bounded`): RE2 never backtracks, Python's engines do, so an
open-ended `.*` or `{64,}?` over hostile text could take quadratic time. A rule finds a secret
where its match holds one of its keywords (so a finding never rests on context the rest of a
stream may bring) and its secret (the rule's secret group, else its first group, else the whole
match) has at least the rule's Shannon entropy. Allow-lists are not applied: they spare
documentation examples in source repositories, and a prompt holding one is refused all the same.

Kept: the rules that name a key or credential by a shape of its own. Left out: those built on an
assignment (ASSIGNMENT: a provider's name, "=", then any run of letters), those that apply to a
kind of file (`path`), and SKIPPED, each with its reason.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
import tomllib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import regex

from appliance.errors import SettingsError

RULES_FILE = Path(__file__).with_name("rules") / "gitleaks.toml"
RULES_SHA256 = "e163e53b9e7e8a8511e77271e2b323ed057759542a6d988258afe3a1fa329caf"  # gitleaks v8.30.1
MOST = 8192  # the bound given to an unbounded repetition: longer than a 4096-bit RSA key's PEM block
# gitleaks' assignment operators: a rule built on them (its semi-generic and generic ones) finds any
# run of letters after a provider's name and "=" or ":", a shape of context, not of the key.
ASSIGNMENT = r"(?:=|>|:{1,3}=|\|\||:|=>|\?=|,)"
SKIPPED = {
    "generic-api-key": "any high-entropy value after a word like key or token: every hash and identifier in code",
    "facebook-access-token": "its keyword is context, not part of the token",
    "airtable-personnal-access-token": "its keyword is context, not part of the token",
    "curl-auth-user": "a password anywhere in a curl command: seconds of backtracking per 64 KiB of 'curl'",
    "curl-auth-header": "a header anywhere in a curl command: seconds of backtracking per 64 KiB of 'curl'",
}
REPEAT = regex.compile(r"\{(\d+),\}")


def bounded(pattern: str) -> str:
    """`pattern` with every unbounded repetition (`*`, `+`, `{n,}`) given at most MOST repeats, and
    Go's `\\z` as Python's `\\Z`. Character classes and escapes are copied as they are."""
    out: list[str] = []
    at, in_class = 0, False
    while at < len(pattern):
        char = pattern[at]
        if char == "\\":
            escape = pattern[at:at + 2]
            out.append(r"\Z" if escape == r"\z" and not in_class else escape)
            at += 2
            continue
        if in_class:
            if pattern.startswith("[:", at):  # a POSIX class inside a set: [[:alnum:]]
                end = pattern.index(":]", at) + 2
                out.append(pattern[at:end])
                at = end
                continue
            in_class = char != "]"
        elif char == "[":
            in_class = True
            out.append(char)
            at += 1
            for first in ("^", "]"):  # a "]" first in a set is a character
                if pattern.startswith(first, at):
                    out.append(first)
                    at += 1
            continue
        elif char in "*+":
            out.append(f"{{{0 if char == '*' else 1},{MOST}}}")
            at += 1
            continue
        elif (repeat := REPEAT.match(pattern, at)) is not None:
            out.append(f"{{{repeat.group(1)},{max(MOST, int(repeat.group(1)))}}}")
            at = repeat.end()
            continue
        out.append(char)
        at += 1
    return "".join(out)


def _leading(nodes: Any) -> tuple[list[str], bool]:
    """The literal texts a parsed pattern's matches begin with (`re`'s parse tree; one a path
    through its alternations), and whether the whole pattern is those texts."""
    constants: Any = getattr(re, "_constants")  # noqa: B009 (private: a failure only leaves a rule not led)
    texts = [""]
    for op, value in nodes:
        if op in (constants.AT, constants.ASSERT, constants.ASSERT_NOT):
            continue  # zero-width
        if op is constants.LITERAL:
            inner, whole = [chr(value)], True
        elif op is constants.SUBPATTERN:
            inner, whole = _leading(value[-1])
        elif op is constants.BRANCH:
            branches = [_leading(branch) for branch in value[1]]
            inner, whole = [text for found, _ in branches for text in found], all(w for _, w in branches)
        else:
            return texts, False
        texts = [text + more for text in texts for more in inner]
        if not whole or len(texts) > 64:
            return texts, False
    return texts, True


def keyword_led(pattern: str, keywords: tuple[str, ...]) -> bool:
    """Whether every match of `pattern` begins with one of `keywords` (in any case): then a match
    can begin only where a keyword, or the start of one at a text's end, is."""
    try:
        parsed = getattr(re, "_parser").parse(pattern.replace("(?i)", "").replace("[:alnum:]", "a-zA-Z0-9"))  # noqa: B009
    except (re.error, ValueError, AttributeError):
        return False
    texts, _ = _leading(parsed)
    return all(any(text.lower().startswith(keyword) for keyword in keywords) for text in texts)


def entropy(text: str) -> float:
    """Shannon entropy in bits per character, as gitleaks computes it."""
    counts = Counter(text)
    return -sum(n / len(text) * math.log2(n / len(text)) for n in counts.values()) if text else 0.0


@dataclass(frozen=True)
class Rule:
    """One vendored rule, compiled."""

    id: str
    pattern: regex.Pattern[str]
    keywords: tuple[str, ...]  # lower case
    entropy: float
    group: int | None  # the secret's group, when the rule names one
    led: bool = False  # every match begins with a keyword (keyword_led)

    def find(self, text: str) -> Iterator[tuple[int, int]]:
        """The spans of the secrets this rule finds in `text`."""
        for match in self.pattern.finditer(text):
            if not any(keyword in match.group().lower() for keyword in self.keywords):
                continue
            group = self.group if self.group is not None else next(
                (index for index in range(1, len(match.groups()) + 1) if match.group(index)), 0)
            start, end = match.span(group)
            if end > start and entropy(text[start:end]) >= self.entropy:
                yield start, end


def _kept(rule: dict[str, object]) -> bool:
    pattern = rule.get("regex")
    return (isinstance(pattern, str) and bool(pattern) and "path" not in rule and rule["id"] not in SKIPPED
            and ASSIGNMENT not in pattern and bool(rule.get("keywords")))


@functools.cache
def rules() -> tuple[Rule, ...]:
    """The vendored rules that name a key or credential by its own shape, compiled (once). A file
    that is not the pinned one is refused: the filter fails closed rather than screen with rules
    nobody reviewed."""
    data = RULES_FILE.read_bytes()
    if hashlib.sha256(data).hexdigest() != RULES_SHA256:
        raise SettingsError(f"{RULES_FILE} is not the vendored gitleaks rule set (its SHA-256 differs)",
                            hint="restore it from the appliance's package")
    compiled = []
    for rule in tomllib.loads(data.decode())["rules"]:
        if not _kept(rule):
            continue
        group = rule.get("secretGroup")
        pattern, words = bounded(rule["regex"]), tuple(keyword.lower() for keyword in rule["keywords"])
        compiled.append(Rule(rule["id"], regex.compile(pattern, regex.V1), words, float(rule.get("entropy", 0)),
                             int(group) if group else None, keyword_led(pattern, words)))
    return tuple(compiled)
