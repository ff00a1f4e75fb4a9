"""One setting written into the settings file's text, the rest of it (comments, order, spacing)
kept as it was.

The file is edited line by line: the key's line has its value replaced (its comment kept), or a
line is added to the table that holds the key (a new table at the end if none does). The result is
then read back and must equal the file's data with just that key changed; anything else (a value
spanning lines, a key written as an inline table) is refused rather than written.
"""

from __future__ import annotations

import copy
import json
import re
import tomllib
from dataclasses import dataclass
from typing import Any

import tomli_w

from appliance.errors import SettingsError

_HEADER = re.compile(r"^\s*(\[\[?)\s*([\w.-]+)\s*\]\]?\s*(#.*)?$")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


@dataclass
class _Block:
    """A table of the file: its key path (a pool's element named by its name) and its lines."""

    path: list[str]
    start: int  # the header's line index (-1: the keys before any header)
    end: int  # one past its last line


def set_in_text(text: str, key: list[str], value: Any, where: str) -> str:
    """`text` with `key` (["gateway", "port"], ["pools", "main", "enable_lora"]) set to `value`;
    SettingsError naming `where` and the key if it cannot be written without changing anything
    else."""
    data = tomllib.loads(text)
    lines = _lines(text)
    blocks = _blocks(lines)
    rendered = render_value(value)
    dotted = ".".join(key)
    found = _find_line(lines, blocks, key)
    if found is not None:
        number, head, rest = found
        value_text, tail = _split_value(rest)
        if value_text is None:
            raise SettingsError(f"{where}: {dotted}: its value spans several lines; edit it by hand")
        lines[number] = f"{head}{rendered}{tail}"
    else:
        _insert(lines, blocks, key, rendered)
    edited = "\n".join(lines) + "\n"
    expected = _with_value(data, key, value)
    try:
        result = tomllib.loads(edited)
    except tomllib.TOMLDecodeError:
        result = None
    if result != expected:
        raise SettingsError(f"{where}: {dotted}: the file's layout keeps it from being set without changing "
                            "other settings", hint="edit it by hand (`appliance settings show --path`)")
    return edited


def _lines(text: str) -> list[str]:
    """The file's lines, split where TOML ends a line (LF or CRLF) only: str.splitlines also breaks
    at U+2028, U+0085 and other separators, which a string value may hold."""
    lines = text.replace("\r\n", "\n").split("\n")
    return lines[:-1] if lines[-1] == "" else lines


def render_value(value: Any) -> str:
    """`value` as a TOML value on one line (a table as an inline table)."""
    if isinstance(value, dict):
        pairs = [f"{_key(name)} = {render_value(item)}" for name, item in value.items()]
        return "{ " + ", ".join(pairs) + " }" if pairs else "{}"
    if isinstance(value, list):
        return "[" + ", ".join(render_value(item) for item in value) + "]"
    return tomli_w.dumps({"v": value})[len("v = "):].rstrip("\n")


def _key(name: str) -> str:
    return name if _BARE_KEY.fullmatch(name) else json.dumps(name)


def _blocks(lines: list[str]) -> list[_Block]:
    """The file's tables in order; a pool's sub-tables ([pools.x]) belong to the pool before them."""
    blocks = [_Block([], -1, len(lines))]
    pool: str | None = None
    for number, line in enumerate(lines):
        header = _HEADER.match(line)
        if not header:
            continue
        blocks[-1].end = number
        parts = header.group(2).split(".")
        if header.group(1) == "[[" and parts == ["pools"]:
            pool = _pool_name(lines, number)
            path = ["pools", pool or ""]
        elif parts[0] == "pools":
            path = ["pools", pool or "", *parts[1:]]
        else:
            path = parts
        blocks.append(_Block(path, number, len(lines)))
    return blocks


def _pool_name(lines: list[str], header: int) -> str | None:
    """The `name = "..."` of the [[pools]] element whose header is at line `header`."""
    for line in lines[header + 1:]:
        if _HEADER.match(line):
            return None
        if re.match(r"^\s*name\s*=", line):
            try:
                name = tomllib.loads(line)["name"]
            except tomllib.TOMLDecodeError:
                return None
            return name if isinstance(name, str) else None
    return None


def _find_line(lines: list[str], blocks: list[_Block], key: list[str]) -> tuple[int, str, str] | None:
    """(line index, text up to and including `=` and a space, text after it) of the line that sets `key`."""
    for block in blocks:
        if block.path != key[:len(block.path)] or len(block.path) == len(key):
            continue
        rest = r"\s*\.\s*".join(re.escape(part) for part in key[len(block.path):])
        pattern = re.compile(rf"^(\s*{rest}\s*=\s*)(.*)$")
        for number in range(block.start + 1, block.end):
            if match := pattern.match(lines[number]):
                return number, match.group(1), match.group(2)
    return None


def _split_value(rest: str) -> tuple[str | None, str]:
    """The value on a line (after `=`) and what follows it (spaces, a comment); (None, rest) if the
    value does not end on this line."""
    cuts = [index for index, char in enumerate(rest) if char == "#"] + [len(rest)]
    for cut in cuts:
        try:
            tomllib.loads(f"v = {rest[:cut]}")
        except tomllib.TOMLDecodeError:
            continue
        value = rest[:cut].rstrip()
        return value, rest[len(value):]
    return None, rest


def _insert(lines: list[str], blocks: list[_Block], key: list[str], rendered: str) -> None:
    """Add `key = rendered` to the deepest table holding the key, after its last setting; else a
    new table at the end."""
    holders = [b for b in blocks if b.path and b.path == key[:len(b.path)] and len(b.path) < len(key)]
    if holders:
        block = max(holders, key=lambda b: len(b.path))
        last = max((n for n in range(block.start + 1, block.end)
                    if lines[n].strip() and not lines[n].lstrip().startswith("#")), default=block.start)
        lines.insert(last + 1, f"{'.'.join(_key(p) for p in key[len(block.path):])} = {rendered}")
        return
    while lines and not lines[-1].strip():
        lines.pop()
    if lines:
        lines.append("")
    if key[0] == "pools":
        lines += ["[[pools]]", f"name = {render_value(key[1])}", f"{'.'.join(_key(p) for p in key[2:])} = {rendered}"]
    else:
        lines += [f"[{'.'.join(_key(p) for p in key[:-1])}]", f"{_key(key[-1])} = {rendered}"]


def _with_value(data: dict[str, Any], key: list[str], value: Any) -> dict[str, Any]:
    """A copy of the file's `data` with `key` set (a pool named by its name, added if missing)."""
    result = copy.deepcopy(data)
    table: Any = result
    parts = key
    if key[0] == "pools":
        pools = result.setdefault("pools", [])
        table = next((p for p in pools if isinstance(p, dict) and p.get("name") == key[1]), None)
        if table is None:
            table = {"name": key[1]}
            pools.append(table)
        parts = key[2:]
    for part in parts[:-1]:
        table = table.setdefault(part, {})
        if not isinstance(table, dict):
            raise SettingsError(f"{'.'.join(key)}: {part} holds a value, not a table of settings")
    table[parts[-1]] = value
    return result
