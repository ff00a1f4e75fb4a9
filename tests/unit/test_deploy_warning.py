"""Training an adapter its pool would not serve is warned of before it starts (finetune submit and
run), naming the setting that serves it and the commands that change it without a restart."""

from __future__ import annotations

from appliance.adapters import Alias
from appliance.roles import Role
from appliance.settings import PoolSettings, Settings
from finetune.cli import deploy_warning


def settings(*pools: tuple[str, bool]) -> Settings:
    return Settings(pools=[PoolSettings(name=name, enable_lora=lora) for name, lora in pools])


def test_pools_serve_adapters_by_default_so_there_is_nothing_to_warn_of() -> None:
    assert Settings().pools[0].enable_lora is True
    assert deploy_warning(Settings(), None, "bot") is None


def test_a_new_name_deploys_on_the_first_pool_and_is_warned_of_where_that_pool_serves_none() -> None:
    warning = deploy_warning(settings(("main", False), ("fast", True)), None, "bot")
    assert warning is not None and "'main'" in warning
    assert "`appliance settings set pools.main.enable_lora true`" in warning and "`appliance settings apply`" in warning
    assert deploy_warning(settings(("main", True), ("fast", False)), None, "bot") is None


def test_a_served_name_is_judged_by_the_pool_it_is_served_on() -> None:
    on_fast = Alias(pool="fast", roles=[Role.USER], stable=1)
    assert deploy_warning(settings(("main", True), ("fast", False)), on_fast, "bot") is not None
    assert deploy_warning(settings(("main", False), ("fast", True)), on_fast, "bot") is None
