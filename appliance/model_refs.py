"""Model references, resolved in one place: 'demo' (the bundled demo model), the name a pool
serves its model under, or a checkpoint directory. Pools, training bases and the CLI's checks
all name models this way."""

from __future__ import annotations

from pathlib import Path

from appliance.errors import Invalid, SettingsError
from appliance.home import Home
from appliance.settings import DEMO_MODEL, PoolSettings, Settings


def model_dir(pool: PoolSettings, home: Home) -> Path:
    """The checkpoint directory a pool serves ('demo' or a directory)."""
    return home.demo_model if pool.model == DEMO_MODEL else Path(pool.model).expanduser()


def served_name(pool: PoolSettings, home: Home) -> str:
    """The name a pool serves its model under (what clients put in 'model')."""
    return pool.served_model_name or model_dir(pool, home).name


def served_models(settings: Settings, home: Home) -> dict[str, Path]:
    """Each pool's served name -> its checkpoint directory."""
    return {served_name(pool, home): model_dir(pool, home) for pool in settings.pools}


def tiers_of_models(settings: Settings, home: Home) -> dict[str, dict[str | None, PoolSettings]]:
    """Each served model name's pools by tier. SettingsError where pools serving one name do not
    each name a tier of their own (a client could not say which it means)."""
    models: dict[str, dict[str | None, PoolSettings]] = {}
    for pool in settings.pools:
        name = served_name(pool, home)
        tiers = models.setdefault(name, {})
        if tiers and (pool.tier is None or None in tiers or pool.tier in tiers):
            other = tiers.get(pool.tier) or next(iter(tiers.values()))
            same = f" as tier {pool.tier!r}" if pool.tier is not None and pool.tier == other.tier else ""
            raise SettingsError(f"pools.{pool.name}.tier: pools {other.name} and {pool.name} both serve {name!r}{same}",
                                hint="give each pool serving one model a tier of its own (e.g. fast, full)")
        tiers[pool.tier] = pool
    return models


def checkpoint(reference: str, home: Home, settings: Settings, *, what: str = "model") -> Path:
    """The checkpoint directory `reference` names; Invalid (saying what was tried) if it is not one."""
    served = served_models(settings, home)
    path = home.demo_model if reference == DEMO_MODEL else served.get(reference) or Path(reference).expanduser()
    if not (path / "config.json").is_file():
        raise Invalid(f"{what} {reference}: {path} has no config.json",
                      hint=f"give '{DEMO_MODEL}', a served model ({', '.join(sorted(served))}) or a checkpoint "
                      "directory")
    return path
