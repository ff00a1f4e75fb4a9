"""Training an adapter its pool would not serve is warned of before it starts (finetune submit and
run), naming the setting that serves it and the commands that change it without a restart."""

from __future__ import annotations

from appliance.adapters import Alias
from appliance.roles import Role
from appliance.settings import PoolSettings, Settings
from finetune.cli import deploy_warning


def settings(*pools: tuple[str, bool]) -> Settings:
    return Settings(pools=[PoolSettings(name=name, enable_lora=lora) for name, lora in pools])


def as_set(pool: PoolSettings) -> bool:
    return bool(pool.enable_lora)


def test_a_pool_that_serves_adapters_is_nothing_to_warn_of() -> None:
    assert deploy_warning(settings(("main", True)), None, "bot", as_set) is None


def test_a_new_name_deploys_on_the_first_pool_and_is_warned_of_where_that_pool_serves_none() -> None:
    warning = deploy_warning(settings(("main", False), ("fast", True)), None, "bot", as_set)
    assert warning is not None and "'main'" in warning
    assert "`appliance settings set pools.main.enable_lora true`" in warning and "`appliance settings apply`" in warning
    assert deploy_warning(settings(("main", True), ("fast", False)), None, "bot", as_set) is None


def test_a_served_name_is_judged_by_the_pool_it_is_served_on() -> None:
    on_fast = Alias(pool="fast", roles=[Role.USER], stable=1)
    assert deploy_warning(settings(("main", True), ("fast", False)), on_fast, "bot", as_set) is not None
    assert deploy_warning(settings(("main", False), ("fast", True)), on_fast, "bot", as_set) is None
