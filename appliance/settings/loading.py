"""Reading the settings: the TOML file, then APPLIANCE_* environment overrides, validated; errors
name the source (file and line, or the environment variable), the field and the reason. Loading
does no I/O beyond reading the file and the environment."""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from appliance.errors import SettingsError
from appliance.home import BACKUP_PASSPHRASE_ENV, HOME_ENV
from appliance.settings.root import Settings

ENV_PREFIX = "APPLIANCE_"
# Not settings: APPLIANCE_HOME picks the state directory itself; a backup passphrase (appliance.home).
_ENV_NOT_SETTINGS = {HOME_ENV, BACKUP_PASSPHRASE_ENV}

# Settings that moved, old name -> new: a file or variable still naming the old one is refused with
# the new name (left unread, it would leave the operator's policy silently unapplied).
MOVED = {("finetune", "sensitive_data"): "compliance.training_data",
         ("finetune", "sensitive_patterns"): "compliance.patterns"}


def load_settings(path: Path, environ: Mapping[str, str] | None = None) -> Settings:
    """Read `path` (missing means all defaults), apply APPLIANCE_* overrides, validate."""
    return parse_settings(path, read_text(path) if path.exists() else None, environ)


def read_text(path: Path) -> str:
    """The settings file's text, or a SettingsError for one that is not UTF-8."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SettingsError(f"{path}: not UTF-8 text (byte {exc.start}): {exc.reason}") from exc


def parse_settings(path: Path, text: str | None, environ: Mapping[str, str] | None = None) -> Settings:
    """`text`, the content of settings file `path` (None: no file, all defaults), with APPLIANCE_*
    overrides, validated; errors name `path` and the line as for the file itself."""
    environ = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    if text is not None:
        try:
            data = tomllib.loads(text)
        except ValueError as exc:  # TOMLDecodeError, and an integer past Python's 4300 digits
            raise SettingsError(f"{path}: not valid TOML: {str(exc)[:300]}") from exc
    text = text or ""
    overrides = _apply_env(data, environ)
    _refuse_moved(path, text, data, overrides)
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = _dotted(error["loc"], data)
        # A section's own rule (fields that must agree) names the variables that set any of them.
        within = [variable for name, variable in overrides.items() if name.startswith(f"{field}.")]
        source = overrides.get(field) or ", ".join(within) or _locate(path, text, error["loc"], data)
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise SettingsError(f"{source}: {field or 'settings'}: {error['msg']}{more}") from exc


def _refuse_moved(path: Path, text: str, data: dict[str, Any], overrides: dict[str, str]) -> None:
    """SettingsError naming the source and the new name of the first setting in MOVED that is set."""
    for (section, key), new in MOVED.items():
        table = data.get(section)
        if isinstance(table, dict) and key in table:
            old = f"{section}.{key}"
            source = overrides.get(old) or _locate(path, text, (section, key), data)
            raise SettingsError(f"{source}: {old} is no longer a setting: it moved to {new}",
                                hint=f"rename it {new} (see `appliance settings defaults`)")


def _apply_env(data: dict[str, Any], environ: Mapping[str, str]) -> dict[str, str]:
    """Fold APPLIANCE_SECTION__FIELD (or APPLIANCE_POOLS__<NAME>__FIELD) into `data`.

    Returns {dotted field: variable name} so errors can point at the variable.
    """
    applied: dict[str, str] = {}
    for var in sorted(environ):
        if not var.startswith(ENV_PREFIX) or var in _ENV_NOT_SETTINGS:
            continue
        path = [part.lower() for part in var[len(ENV_PREFIX):].split("__")]
        value = parse_value(environ[var])
        if path[0] == "pools":
            if len(path) != 3:
                raise SettingsError(f"{var}: pool overrides look like APPLIANCE_POOLS__<NAME>__<FIELD>")
            pools = data.setdefault("pools", [{"name": "main"}])
            pool = next((p for p in pools if isinstance(p, dict) and p.get("name") == path[1]), None)
            if pool is None:
                raise SettingsError(f"{var}: no pool named {path[1]!r} in the settings file")
            pool[path[2]] = value
            applied[f"pools.{path[1]}.{path[2]}"] = var
            continue
        if len(path) != 2 or path[0] not in Settings.model_fields:
            raise SettingsError(
                f"{var}: unknown setting", hint="overrides look like APPLIANCE_<SECTION>__<FIELD>"
            )
        section = data.setdefault(path[0], {})
        section[path[1]] = value
        applied[".".join(path)] = var
    return applied


def parse_value(raw: str) -> Any:
    """A TOML value if it parses as one (numbers, booleans, arrays), else the raw string (an
    override's value, or one given to `appliance settings set`)."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _dotted(loc: tuple[int | str, ...], data: dict[str, Any]) -> str:
    """('pools', 0, 'port') -> 'pools.main.port' (pools are named by name, not index)."""
    parts: list[str] = []
    for i, part in enumerate(loc):
        if isinstance(part, int) and loc[:i] == ("pools",):
            pools = data.get("pools") or []
            name = pools[part].get("name") if part < len(pools) and isinstance(pools[part], dict) else None
            parts.append(str(name) if name else str(part))
        else:
            parts.append(str(part))
    return ".".join(parts)


def _locate(path: Path, text: str, loc: tuple[int | str, ...], data: dict[str, Any]) -> str:
    """'FILE:LINE' of the key the error is about, or 'FILE' (or 'defaults') if it has no line."""
    if not text:
        return "defaults" if not path.exists() else str(path)
    table = [str(p) for p in loc[:-1] if not isinstance(p, int)]
    key = str(loc[-1]) if loc and not isinstance(loc[-1], int) else None
    index = next((p for p in loc if isinstance(p, int)), None)
    current: list[str] = []
    array_seen = -1
    for number, line in enumerate(text.splitlines(), start=1):
        header = re.match(r"^\s*(\[\[?)\s*([\w.-]+)\s*\]\]?", line)
        if header:
            current = header.group(2).split(".")
            if key and header.group(1) == "[" and current == [*table, key]:
                return f"{path}:{number}"  # the error is about the whole section
            if header.group(1) == "[[" and current == table:
                array_seen += 1
            continue
        if key and current == table and (index is None or index == array_seen):
            if re.match(rf"^\s*{re.escape(key)}\s*=", line):
                return f"{path}:{number}"
    return str(path)
