"""Look-alike letters read as the ASCII letters and digits they imitate ("ѕк-" as "sk-", a Cyrillic
"В" in an IBAN as "B"): a one-for-one fold, a `str.translate` table, built from Unicode's
confusables as the pinned `confusable-homoglyphs` package ships them (its `confusables.json`).

The data maps each confusable character to a prototype and lists, under each prototype, what maps
to it; a class is a prototype with everything mapped to it. Only a letter or number (general
category L or N) that NFKC leaves as it is (the scanner's view is NFKC already) is folded, and only
to a single ASCII letter or digit: symbols and punctuation stay what they are to the scanner,
separators.
"""

from __future__ import annotations

import functools
import json
import unicodedata
from importlib.resources import files

import numpy as np
import numpy.typing as npt

DATA_PACKAGE = "confusable_homoglyphs"
SMALL_CAPITAL = "LATIN LETTER SMALL CAPITAL "


def _classes(data: dict[str, list[dict[str, str]]]) -> dict[str, frozenset[str]]:
    """Each character's class: the characters linked to it by the data, one code point each."""
    parent: dict[str, str] = {}

    def root(char: str) -> str:
        while parent.setdefault(char, char) != char:
            char = parent[char]
        return char

    for char, homoglyphs in data.items():
        for homoglyph in homoglyphs:
            if len(char) == 1 and len(homoglyph["c"]) == 1:
                parent[root(char)] = root(homoglyph["c"])
    members: dict[str, set[str]] = {}
    for char in parent:
        members.setdefault(root(char), set()).add(char)
    return {char: frozenset(members[root(char)]) for char in parent}


def _ascii(char: str) -> bool:
    return char.isascii() and char.isalnum()


def _choice(char: str, members: frozenset[str], prototype: str | None) -> str | None:
    """The ASCII letter or digit `char` folds to. A class may hold several ({l, I, 1}, {O, 0}):
    a capital takes the class's one capital (Cyrillic "І" is read "I", not Unicode's prototype
    "l"), a small letter its one small letter; an uncased one, or a case the class lacks, takes
    Unicode's prototype. A class with none takes the letter its one Latin small capital names, in
    small (Cyrillic "к", Greek "κ": their class's prototype is the kra "ĸ", its small capital "ᴋ":
    "k"). Anything else is left as it is."""
    found = sorted(member for member in members if _ascii(member))
    if found:
        cased = [m for m in found if m.isupper()] if char.isupper() else [m for m in found if m.islower()] \
            if char.islower() else []
        if len(cased) == 1:
            return cased[0]
        return prototype if prototype in found else found[0] if len(found) == 1 else None
    capitals = {name[len(SMALL_CAPITAL):] for member in members
                if (name := unicodedata.name(member, "")).startswith(SMALL_CAPITAL)}
    letters = [name.lower() for name in capitals if len(name) == 1]
    return letters[0] if len(letters) == 1 and len(capitals) == 1 else None


@functools.cache
def table() -> dict[int, str]:
    """The fold, by code point (`str.translate`): look-alike letters and numbers to ASCII."""
    data = json.loads(files(DATA_PACKAGE).joinpath("confusables.json").read_text("utf-8"))
    fold: dict[int, str] = {}
    for char, members in _classes(data).items():
        if (char.isascii() or unicodedata.category(char)[0] not in "LN" or unicodedata.digit(char, None) is not None
                or unicodedata.normalize("NFKC", char) != char):  # digits: the view reads them by value
            continue
        direct = data.get(char, [])
        prototype = direct[0]["c"] if len(direct) == 1 else None
        if (ascii_char := _choice(char, members, prototype)) is not None:
            fold[ord(char)] = ascii_char
    return fold


class _Folded(dict[int, str]):
    """The fold, every other character as itself (a `str.translate` table that raises no lookup
    error per character it does not fold)."""

    def __missing__(self, code: int) -> str:
        self[code] = char = table().get(code, chr(code))
        return char


FOLDED = _Folded()
SHORT = 256  # up to this long, a text is folded by `str.translate`; longer, by numpy (cheaper per character)


@functools.cache
def _lookup() -> npt.NDArray[np.uint32]:
    """The fold as an array: every code point up to the last folded one, to what it is read as."""
    fold = table()
    codes = np.arange(max(fold) + 1, dtype=np.uint32)
    codes[list(fold)] = [ord(char) for char in fold.values()]
    return codes


@functools.lru_cache(maxsize=4)  # a stream's held text is scanned twice: for findings, then what is pending
def folded(text: str) -> str:
    """`text` with look-alikes as the ASCII they imitate, one character for one."""
    if text.isascii():
        return text
    if len(text) <= SHORT:
        return text.translate(FOLDED)
    lookup = _lookup()
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32)
    read = np.where(codes < len(lookup), lookup[np.minimum(codes, len(lookup) - 1)], codes)
    return read.astype("<u4").tobytes().decode("utf-32-le", "surrogatepass")
