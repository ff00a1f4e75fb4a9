"""LoRA adapters behind the gateway.

Routing: a request for an adapter's name goes to the version its alias serves (a canary takes
its share of requests at random), on the alias's pool, for the roles the alias allows; after a
rollback past the first version, the name serves nothing: its requests are refused (409
adapter_not_deployed), never answered by the base model, and /v1/models leaves it out.

Changing what is served (deploy, canary, rollback, retire; the admin API) loads and unloads
adapters in the running vLLM engine through its runtime LoRA endpoints, so nothing restarts. An
adapter's files are copied from the artifact store into the state dir before vLLM loads them.
vLLM forgets its adapters when it restarts; a request that finds its adapter gone reloads it
and is sent again, once.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio

from appliance import adapters
from appliance.adapters import (
    AdapterRecord,
    Alias,
    Registry,
    ServingChange,
    check_base,
    deploy_pool,
    not_deployed,
)
from appliance.artifacts import ArtifactStore
from appliance.canary import CanaryAnalysis
from appliance.durable import replace_file
from appliance.errors import ApplianceError, Conflict, IntegrityError, NotFound
from appliance.home import Home
from appliance.model_refs import model_dir
from appliance.records import config_sha256
from appliance.roles import Role
from appliance.settings import Settings
from serve.canary import CanaryWatch, Ended
from serve.errors import GatewayError, from_core
from serve.replicas import Pool
from serve.upstream import Upstreams

log = logging.getLogger("appliance.gateway")


class AdapterRoutes:
    """The registry as the gateway sees it (re-read when its file changes: the trainer registers
    versions from another process) and the operations that change what is served."""

    def __init__(self, home: Home, upstreams: Upstreams, store: ArtifactStore,
                 base_configs: dict[str, str], on_change: Callable[[str], object] | None = None) -> None:
        self.home = home
        self.on_change = on_change  # told the name whose serving changed (the response cache forgets its answers)
        self.upstreams = upstreams
        self.store = store
        self.base_configs = base_configs  # pool name -> config.json SHA-256 of the model it serves
        self._registry = Registry()
        self._stamp: int | None = None
        self._lock = asyncio.Lock()  # one change at a time
        self.canaries = CanaryWatch()

    def registry(self) -> Registry:
        path = adapters.registry_path(self.home)
        try:
            stamp = path.stat().st_mtime_ns
        except FileNotFoundError:
            stamp = None
        if stamp != self._stamp:
            self._registry, self._stamp = adapters.load(self.home), stamp
        return self._registry

    # -- routing ------------------------------------------------------------------------------

    def resolve(self, model: object, roles: frozenset[str]) -> tuple[Pool, str, AdapterRecord] | None:
        """(pool, model name for the engine, the adapter version chosen) for an adapter's name; None
        if `model` names no adapter; refused (409) if the name has no version deployed."""
        alias = self.registry().aliases.get(model) if isinstance(model, str) else None
        if alias is None:
            return None
        if not roles & set(alias.roles):
            raise GatewayError(403, f"adapter {model!r} is not available to your roles", type="permission_error",
                               code="adapter_forbidden")
        if alias.stable is None:
            raise GatewayError(409, not_deployed(str(model), "no request for it is answered"),
                               code="adapter_not_deployed", param="model")
        pool = self.upstreams.pool(alias.pool)
        version = alias.canary if alias.canary is not None and random.random() < alias.canary_share else alias.stable
        record = self.registry().find(str(model), version)
        return pool, record.engine_name, record

    def visible(self, roles: frozenset[str]) -> list[dict[str, str]]:
        """/v1/models entries for the adapter names these roles may call (not those whose pool is
        no longer in the settings, nor those with no version deployed: calling one says so)."""
        pools = {pool.name: pool for pool in self.upstreams.pools}
        return [{"id": name, "object": "model", "owned_by": "appliance", "parent": pools[alias.pool].model}
                for name, alias in sorted(self.registry().aliases.items())
                if roles & set(alias.roles) and alias.pool in pools and alias.stable is not None]

    # -- changes (their rules are the registry's: appliance.adapters) ---------------------------

    async def deploy(self, name: str, version: int | None, pool_name: str | None, roles: list[Role] | None) -> Alias:
        """Serve `version` (default: the newest that passed its gate) under `name`, all requests."""
        current = self.registry().aliases.get(name)
        pool = self.upstreams.pool(pool_name or deploy_pool(current, [pool.name for pool in self.upstreams.pools])
                                   or "")
        return await self._change(name, lambda registry: registry.deploy(name, version, pool.name, roles))

    async def canary(self, name: str, version: int, share: float, analysis: CanaryAnalysis | None = None) -> Alias:
        """Send `share` of the requests for `name` to `version`, the rest to the stable version;
        with `analysis`, judged window by window and promoted or aborted (serve.canary)."""
        return await self._change(name, lambda registry: registry.canary(name, version, share, analysis))

    def canary_status(self, name: str) -> dict[str, object]:
        """`name`'s canary as it runs: the two versions, the canary's share and, when it is judged,
        its current window (`analysis`; None when it is not). NotFound when it has no canary."""
        alias = self.registry().alias(name)
        if alias.canary is None:
            raise NotFound(f"adapter {name!r} has no canary")
        return {"stable": alias.stable, "canary": alias.canary, "canary_share": alias.canary_share,
                "analysis": self.canaries.status(name, alias)}

    async def rollback(self, name: str) -> Alias:
        """Drop the canary if there is one; else serve the version served before (or, past the
        first, none)."""
        return await self._change(name, lambda registry: registry.rollback(name))

    async def retire(self, name: str, version: int | None) -> list[AdapterRecord]:
        """Retire a version that is not served, or the whole name."""
        change = await self._apply(name, lambda registry: registry.retire(name, version))
        return list(change.unload)

    async def follow_canaries(self, record: Callable[[Ended, str | None], Awaitable[None]],
                              tick_s: float = 1.0) -> None:
        """Every `tick_s`: end the canary windows whose time is up, and promote or abort as they
        say (only the canary that was judged: one changed meanwhile is left alone), each decision
        recorded with the error if it could not be made."""
        while True:
            await anyio.sleep(tick_s)
            try:
                # Judging a window is CPU work (about 20 ms at a thousand users reporting): off the loop.
                aliases = self.registry().aliases
                for ended in await anyio.to_thread.run_sync(self.canaries.tick, aliases):
                    if ended.decision != "continue":
                        await record(ended, await self._carry_out(ended))
            except Exception:  # an unreadable registry, say: the next tick; never the gateway's other tasks
                log.exception("canary analysis")

    async def _carry_out(self, ended: Ended) -> str | None:
        """Promote or abort as `ended` says; why it could not (None: done)."""
        try:
            await self._apply(ended.name, functools.partial(self._decided, ended=ended))
        except (ApplianceError, GatewayError) as exc:
            log.warning("canary %s v%d: %s not carried out: %s", ended.name, ended.window.canary, ended.decision,
                        exc.message)
            return exc.message
        except OSError as exc:  # the registry's file (a full disk): the change is not made
            log.warning("canary %s v%d: %s not carried out: %s", ended.name, ended.window.canary, ended.decision, exc)
            return f"the adapter registry could not be written: {exc}"
        return None

    @staticmethod
    def _decided(registry: Registry, *, ended: Ended) -> ServingChange:
        alias = registry.alias(ended.name)
        if (alias.stable, alias.canary, alias.canary_analysis) != \
                (ended.window.stable, ended.window.canary, ended.window.policy):
            raise Conflict(f"{ended.name}'s canary changed while it was judged")
        if ended.decision == "promote":
            return registry.deploy(ended.name, ended.window.canary, alias.pool, alias.roles)
        return registry.rollback(ended.name)

    async def _change(self, name: str, rule: Callable[[Registry], ServingChange]) -> Alias:
        await self._apply(name, rule)
        return self.registry().alias(name)

    async def _apply(self, name: str, rule: Callable[[Registry], ServingChange]) -> ServingChange:
        """Run `rule` on a copy of the registry (a refusal there changes nothing and asks no
        engine), give the engine what the change needs, then run it for real and write it."""
        async with self._lock:
            planned = rule(self.registry().model_copy(deep=True))
            if planned.load is not None and planned.pool is not None:
                pool = self.upstreams.pool(planned.pool)  # a pool no longer configured: 404
                check_base(planned.load, pool.name, pool.model, self.base_configs.get(pool.name))
                await self.load(pool, planned.load)
            self._stamp = None  # the cached copy is re-read after the write
            # In a thread: the registry's file lock may be held by the trainer registering a version.
            change = await anyio.to_thread.run_sync(self._write, rule, planned)
            if self.on_change is not None:
                self.on_change(name)
            # Unloading needs no configured pool: retiring an adapter whose pool was removed works.
            configured = {pool.name: pool for pool in self.upstreams.pools}
            if change.pool in configured:
                for record in change.unload:
                    await self._unload(configured[change.pool], record.engine_name)
            return change

    def _write(self, rule: Callable[[Registry], ServingChange], planned: ServingChange) -> ServingChange:
        """`rule` run on the registry under its lock and written; refused (nothing written) if the
        registry changed since `planned` so that it would serve another version than the one loaded
        (a deploy of "the newest" while the trainer registered a newer one)."""
        with adapters.updating(self.home) as registry:
            change = rule(registry)
            if _version(change.load) != _version(planned.load):
                raise Conflict("the adapter registry changed while the engine loaded the version; try again")
        return change

    # -- engine and files ---------------------------------------------------------------------

    async def load(self, pool: Pool, record: AdapterRecord) -> None:
        """Load a version into its pool's engine (again, after the engine restarted and forgot it)."""
        try:
            directory = await anyio.to_thread.run_sync(self._materialize, record)
        except ApplianceError as exc:  # a GatewayError, as the engine's own refusals: the request path counts them
            raise from_core(exc) from exc
        answers = await self.upstreams.engine_post(pool, "/v1/load_lora_adapter",
                                                   {"lora_name": record.engine_name, "lora_path": str(directory)})
        for replica, status, text in answers:  # every replica that answers holds it
            if status == 200 or "already been loaded" in text:
                continue
            if status == 404:
                raise GatewayError(409, f"engine pool {pool.name!r} does not serve adapters (set "
                                   f"pools.{pool.name}.enable_lora = true and restart it)", code="lora_disabled")
            raise GatewayError(502, f"engine {replica.name!r} of pool {pool.name!r} refused {record.engine_name}: "
                               f"{text[:300]}", type="upstream_error", code="engine_error")

    async def _unload(self, pool: Pool, engine_name: str) -> None:
        try:
            await self.upstreams.engine_post(pool, "/v1/unload_lora_adapter", {"lora_name": engine_name})
        except GatewayError:
            pass  # the engine is down: it holds no adapters now

    def _materialize(self, record: AdapterRecord) -> Path:
        """The version's files in the state dir (copied from the artifact store once). Requests that
        find the version unloaded at once each copy it into a directory of their own; the first
        to finish puts it in place."""
        directory = self.home.root / "adapters" / record.name / f"v{record.version}"
        if (directory / "adapter_config.json").is_file():
            return directory
        for level in (directory.parent.parent, directory.parent):  # the engine, the gateway's own user, reads them
            level.mkdir(mode=0o700, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", suffix=".partial", dir=directory.parent))
        try:
            try:
                files = {key.rsplit("/", 1)[-1]: self.store.get(key) for key in self.store.keys(record.artifact)}
            except ApplianceError as exc:
                raise GatewayError(503, f"cannot fetch {record.name} v{record.version}: {exc.message}",
                                   type="service_unavailable", code="artifact_store") from exc
            try:
                adapters.check_files(record, files)
            except IntegrityError as exc:
                log.error("adapter artifact refused: %s", exc.one_line())
                raise
            for name, data in files.items():
                replace_file(partial / name, data)
            try:
                partial.rename(directory)
            except OSError:
                if not (directory / "adapter_config.json").is_file():  # not another request's copy in place
                    raise
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        return directory


def base_configs(settings: Settings, home: Home) -> dict[str, str]:
    """Each pool's model identity (config.json SHA-256), to refuse adapters trained on another."""
    found = {}
    for pool in settings.pools:
        try:
            found[pool.name] = config_sha256(json.loads((model_dir(pool, home) / "config.json").read_text()))
        except (OSError, ValueError):
            continue  # a missing model is reported by /readyz and the engine itself
    return found


def _version(record: AdapterRecord | None) -> tuple[str, int] | None:
    return (record.name, record.version) if record is not None else None
