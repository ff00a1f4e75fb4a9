"""Writing the settings back out: every default as a commented settings.toml, the settings'
documentation (`appliance settings defaults`)."""

from __future__ import annotations

from typing import Any

import tomli_w
from pydantic import BaseModel

from appliance.settings.root import Settings


def render_defaults() -> str:
    """A commented settings.toml holding every default: the settings' documentation."""
    lines = ["# Appliance settings. Every key is optional; shown with its default.",
             "# Environment overrides: APPLIANCE_<SECTION>__<FIELD>, APPLIANCE_POOLS__<NAME>__<FIELD>.", ""]
    defaults = Settings()
    for section in Settings.model_fields:  # every section, so none is left undocumented
        if section == "pools":
            continue
        lines.append(f"[{section}]")
        lines += _render_fields(getattr(defaults, section), section)
        lines.append("")
    for pool in defaults.pools:
        lines.append("[[pools]]")
        lines += _render_fields(pool, "pools")
    return "\n".join(lines) + "\n"


def _render_fields(model: BaseModel, table: str) -> list[str]:
    """Each field of `model`, the TOML table `table`, under its description. A field holding a
    table comes last, as `[table.field]`: a key after it would belong to it."""
    data = model.model_dump(mode="json")
    keys: list[str] = []
    tables: list[str] = []
    for name, info in type(model).model_fields.items():
        value = _without_nulls(data[name])
        if value is None:
            keys += [f"# {info.description}", f"# {name} = (unset)"]
        elif isinstance(value, dict):
            tables += [f"# {info.description}", tomli_w.dumps({table: {name: value}}).rstrip("\n")]
        else:
            keys += [f"# {info.description}", tomli_w.dumps({name: value}).rstrip("\n")]
    return keys + tables


def _without_nulls(value: Any) -> Any:
    """JSON data with None left out of its tables: TOML has no null, and an unset field takes its
    default."""
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value
