"""LoRA adapters behind the gateway.

Routing: a request for an adapter's name goes to the version its alias serves (a canary takes
its share of requests at random), on the alias's pool, for the roles the alias allows; after a
rollback past the first version, the name serves the pool's base model.

Changing what is served (deploy, canary, rollback, retire; the admin API) loads and unloads
adapters in the running vLLM engine through its runtime LoRA endpoints, so nothing restarts. An
adapter's files are copied from the artifact store into the state dir before vLLM loads them.
vLLM forgets its adapters when it restarts; a request that finds its adapter gone reloads it
and is sent again, once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from contextlib import AbstractContextManager
from pathlib import Path

import anyio

from appliance import adapters
from appliance.adapters import AdapterRecord, AdapterState, Alias, Registry
from appliance.artifacts import ArtifactStore
from appliance.errors import ApplianceError, IntegrityError
from appliance.home import Home
from appliance.records import config_sha256
from appliance.settings import Settings
from serve.engine import model_dir
from serve.errors import GatewayError
from serve.upstream import Pool, Upstreams

log = logging.getLogger("appliance.gateway")


class AdapterRoutes:
    """The registry as the gateway sees it (re-read when its file changes: the trainer registers
    versions from another process) and the operations that change what is served."""

    def __init__(self, home: Home, upstreams: Upstreams, store: ArtifactStore,
                 base_configs: dict[str, str]) -> None:
        self.home = home
        self.upstreams = upstreams
        self.store = store
        self.base_configs = base_configs  # pool name -> config.json SHA-256 of the model it serves
        self._registry = Registry()
        self._stamp: int | None = None
        self._lock = asyncio.Lock()  # one change at a time

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

    def resolve(self, model: object, roles: frozenset[str]) -> tuple[Pool, str, AdapterRecord | None] | None:
        """(pool, model name for the engine, the adapter version chosen or None for the base) for
        an adapter's name; None if `model` names no adapter."""
        alias = self.registry().aliases.get(model) if isinstance(model, str) else None
        if alias is None:
            return None
        if not roles & set(alias.roles):
            raise GatewayError(403, f"adapter {model!r} is not available to your roles", type="permission_error",
                               code="adapter_forbidden")
        pool = self.upstreams.pool(alias.pool)
        version = alias.canary if alias.canary is not None and random.random() < alias.canary_share else alias.stable
        if version is None:
            return pool, pool.model, None
        record = self.registry().find(str(model), version)
        return pool, record.engine_name, record

    def visible(self, roles: frozenset[str]) -> list[dict]:
        """/v1/models entries for the adapter names these roles may call (not those whose pool is
        no longer in the settings: calling one says so)."""
        pools = {pool.name: pool for pool in self.upstreams.pools}
        return [{"id": name, "object": "model", "owned_by": "appliance", "parent": pools[alias.pool].model}
                for name, alias in sorted(self.registry().aliases.items())
                if roles & set(alias.roles) and alias.pool in pools]

    # -- changes ------------------------------------------------------------------------------

    async def deploy(self, name: str, version: int | None, pool_name: str | None, roles: list[str] | None) -> Alias:
        """Serve `version` (default: the newest that passed its gate) under `name`, all requests."""
        async with self._lock:
            registry = self.registry()
            record = _changeable(registry, name, version, AdapterState.DEPLOYED)
            current = registry.aliases.get(name)
            pool = self.upstreams.pool(pool_name or (current.pool if current else self.upstreams.pools[0].name))
            self._check_base(record, pool)
            await self.load(pool, record)
            with self._updating() as registry:
                alias = registry.aliases.get(name) or Alias(pool=pool.name, roles=roles or ["user", "admin"],
                                                             stable=None)
                if alias.stable is not None and alias.stable != record.version:
                    alias.history.append(alias.stable)
                    registry.move(name, alias.stable, AdapterState.REGISTERED)
                if alias.canary is not None and alias.canary != record.version:
                    registry.move(name, alias.canary, AdapterState.REGISTERED)
                alias.pool, alias.roles = pool.name, roles or alias.roles
                alias.stable, alias.canary, alias.canary_share = record.version, None, 0.0
                registry.move(name, record.version, AdapterState.DEPLOYED)
                registry.aliases[name] = alias
            return alias

    async def canary(self, name: str, version: int, share: float) -> Alias:
        """Send `share` of the requests for `name` to `version`, the rest to the stable version."""
        async with self._lock:
            registry = self.registry()
            alias = _alias(registry, name)
            if version == alias.stable:
                raise GatewayError(409, f"{name} v{version} is already the stable version", code="conflict")
            record = _changeable(registry, name, version, AdapterState.CANARY)
            pool = self.upstreams.pool(alias.pool)
            self._check_base(record, pool)
            await self.load(pool, record)
            with self._updating() as registry:
                alias = registry.aliases[name]
                if alias.canary is not None and alias.canary != version:
                    registry.move(name, alias.canary, AdapterState.REGISTERED)
                alias.canary, alias.canary_share = version, share
                registry.move(name, version, AdapterState.CANARY)
            return alias

    async def rollback(self, name: str) -> Alias:
        """Drop the canary if there is one; else serve the version served before (or the base)."""
        async with self._lock:
            alias = _alias(self.registry(), name)
            pool = self.upstreams.pool(alias.pool)
            if alias.canary is not None:
                dropped = alias.canary
            else:
                if alias.stable is None:
                    raise GatewayError(409, f"{name!r} already serves the base model; nothing to roll back",
                                       code="conflict")
                dropped = alias.stable
                previous = alias.history[-1] if alias.history else None
                if previous is not None:
                    await self.load(pool, self.registry().find(name, previous))
            with self._updating() as registry:
                alias = registry.aliases[name]
                if alias.canary is not None:
                    alias.canary, alias.canary_share = None, 0.0
                else:
                    alias.stable = alias.history.pop() if alias.history else None
                    if alias.stable is not None:
                        registry.move(name, alias.stable, AdapterState.DEPLOYED)
                registry.move(name, dropped, AdapterState.REGISTERED)
            await self._unload(pool, adapters.engine_name(name, dropped))
            return alias

    async def retire(self, name: str, version: int | None) -> list[AdapterRecord]:
        """Retire one version (not while it is served), or (no version) the name: every version
        unloaded and retired, the name no longer served."""
        async with self._lock:
            registry = self.registry()
            alias = registry.aliases.get(name)
            targets = [registry.find(name, version)] if version is not None else registry.versions(name)
            if not targets:
                registry.find(name, None)  # raises: no such adapter
            if version is not None and alias is not None and version in (alias.stable, alias.canary):
                raise GatewayError(409, f"{name} v{version} is being served; deploy another version or roll "
                                   "back first", code="conflict")
            with self._updating() as registry:
                if version is None:
                    registry.aliases.pop(name, None)
                for record in targets:
                    registry.move(name, record.version, AdapterState.RETIRED)
                    if version is not None and alias is not None and version in alias.history:
                        registry.aliases[name].history.remove(version)
            if alias is not None:
                for record in targets:
                    await self._unload(self.upstreams.pool(alias.pool), record.engine_name)
            return [self.registry().find(name, record.version) for record in targets]

    # -- engine and files ---------------------------------------------------------------------

    def _check_base(self, record: AdapterRecord, pool: Pool) -> None:
        served = self.base_configs.get(pool.name)
        if served is not None and served != record.base_config_sha256:
            raise GatewayError(409, f"{record.name} v{record.version} was trained on {record.base_model}, not on "
                               f"the model pool {pool.name!r} serves ({pool.model})", code="base_mismatch")

    async def load(self, pool: Pool, record: AdapterRecord) -> None:
        """Load a version into its pool's engine (again, after the engine restarted and forgot it)."""
        directory = await anyio.to_thread.run_sync(self._materialize, record)
        status, text = await self.upstreams.engine_post(pool, "/v1/load_lora_adapter",
                                                        {"lora_name": record.engine_name, "lora_path": str(directory)})
        if status == 200 or "already been loaded" in text:
            return
        if status == 404:
            raise GatewayError(409, f"engine pool {pool.name!r} does not serve adapters (set "
                               f"pools.{pool.name}.enable_lora = true and restart it)", code="lora_disabled")
        raise GatewayError(502, f"engine pool {pool.name!r} refused {record.engine_name}: {text[:300]}",
                           type="upstream_error", code="engine_error")

    async def _unload(self, pool: Pool, engine_name: str) -> None:
        try:
            await self.upstreams.engine_post(pool, "/v1/unload_lora_adapter", {"lora_name": engine_name})
        except GatewayError:
            pass  # the engine is down: it holds no adapters now

    def _materialize(self, record: AdapterRecord) -> Path:
        """The version's files in the state dir (copied from the artifact store once)."""
        directory = self.home.root / "adapters" / record.name / f"v{record.version}"
        if (directory / "adapter_config.json").is_file():
            return directory
        partial = directory.with_name(f".{directory.name}.partial")
        partial.mkdir(parents=True, exist_ok=True)
        try:
            files = {key.rsplit("/", 1)[-1]: self.store.get(key) for key in self.store.keys(record.artifact)}
        except ApplianceError as exc:
            raise GatewayError(503, f"cannot fetch {record.name} v{record.version}: {exc.message}",
                               type="service_unavailable", code="artifact_store") from exc
        try:
            adapters.check_files(record, files)
        except IntegrityError as exc:
            log.error("adapter artifact refused: %s", exc.one_line())
            raise GatewayError(409, exc.one_line(), type="invalid_request_error", code="artifact_integrity") from exc
        for name, data in files.items():
            (partial / name).write_bytes(data)
        partial.rename(directory)
        return directory

    def _updating(self) -> AbstractContextManager[Registry]:
        """The registry, changed and written back; the cached copy is refreshed afterwards."""
        self._stamp = None
        return adapters.updating(self.home)


def base_configs(settings: Settings, home: Home) -> dict[str, str]:
    """Each pool's model identity (config.json SHA-256), to refuse adapters trained on another."""
    found = {}
    for pool in settings.pools:
        try:
            found[pool.name] = config_sha256(json.loads((model_dir(pool, home) / "config.json").read_text()))
        except (OSError, ValueError):
            continue  # a missing model is reported by /readyz and the engine itself
    return found


def _alias(registry: Registry, name: str) -> Alias:
    alias = registry.aliases.get(name)
    if alias is None:
        raise GatewayError(404, f"adapter {name!r} is not deployed", code="not_found")
    return alias


def _changeable(registry: Registry, name: str, version: int | None, to: AdapterState) -> AdapterRecord:
    """The version to serve, checked against its state machine before any engine is asked."""
    record = registry.find(name, version)
    adapters.check_move(record, to)  # IllegalTransition: a 409 naming the move
    return record
