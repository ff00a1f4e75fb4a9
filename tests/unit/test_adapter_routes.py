"""Routing to adapters and the changes to what is served (deploy, canary, rollback, retire)
against a stand-in engine that records its LoRA calls; the real engine is in
tests/integration/test_adapters.py."""

from __future__ import annotations

import asyncio
import re
import stat
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from starlette.requests import Request

from appliance import adapters
from appliance.adapters import MOVES, AdapterRecord, AdapterState
from appliance.artifacts import LocalStore
from appliance.canary import CanaryAnalysis
from appliance.errors import ApplianceError, Conflict, IllegalTransition, NotFound
from appliance.home import Home
from appliance.jobs import Hyperparameters
from appliance.roles import Role
from audit import AuditWriter, read_records
from serve.adapters import AdapterRoutes
from serve.context import context_of
from serve.errors import GatewayError, from_core
from serve.relay import relay
from serve.replicas import Pool, Replica
from serve.schemas import ChatRequest
from tests.support.records import metrics
from tests.unit import test_request_context as through_gateway

USERS = frozenset({"user"})


class Engine:
    """Upstreams' pool lookup and engine_post, recording what vLLM would be asked."""

    def __init__(self) -> None:
        replicas = (Replica("main", Path("/nonexistent/main.sock")), Replica("main_1", Path("/nonexistent/m1.sock")))
        self.pools = [Pool(name="main", model="base-model", replicas=replicas)]
        self.loaded: set[str] = set()
        self.lora = True

    def pool(self, name: str) -> Pool:
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise GatewayError(404, f"no engine pool named {name!r}")

    async def engine_post(self, pool: Pool, path: str, body: dict) -> list[tuple[Replica, int, str]]:
        """Each replica's answer; the second as one that already holds what it is asked to load."""
        if not self.lora:
            return [(replica, 404, "Not Found") for replica in pool.replicas]
        if path == "/v1/load_lora_adapter":
            assert (Path(body["lora_path"]) / "adapter_config.json").is_file()
            self.loaded.add(body["lora_name"])
        else:
            self.loaded.discard(body["lora_name"])
        first, second = pool.replicas
        if path == "/v1/load_lora_adapter":
            return [(first, 200, "ok"), (second, 400, "The lora adapter has already been loaded")]
        return [(first, 200, "ok"), (second, 200, "ok")]


@pytest.fixture
def routes(tmp_path: Path, home: Home) -> AdapterRoutes:
    store = LocalStore(tmp_path / "store")
    with adapters.updating(home) as registry:
        for version, state in ((1, "registered"), (2, "registered"), (3, "failed-gate")):
            artifact = f"adapters/codes/v{version}/"
            store.put(artifact + "adapter_config.json", b"{}", retain_days=0)
            store.put(artifact + "adapter_model.safetensors", b"weights", retain_days=0)
            registry.adapters.append(AdapterRecord(
                name="codes", version=version, base_model="demo", base_config_sha256="base", dataset="d",
                dataset_sha256="x", hyperparameters=Hyperparameters(), metrics=metrics(), artifact=artifact,
                state=state))
    return AdapterRoutes(home, Engine(), store, {"main": "base"})  # type: ignore[arg-type]


def run(coroutine):
    return asyncio.run(coroutine)


def refusal(call: Any) -> GatewayError:
    """What the gateway answers for `call`'s error: its own, or the core's through its one table."""
    try:
        run(call)
    except GatewayError as exc:
        return exc
    except ApplianceError as exc:
        return from_core(exc)
    raise AssertionError("the call was not refused")


def served(routes: AdapterRoutes, roles: frozenset[str] = USERS) -> str:
    resolved = routes.resolve("codes", roles)
    assert resolved is not None
    return resolved[1]


def test_deploy_serves_the_newest_passing_version_and_loads_it(routes: AdapterRoutes) -> None:
    assert routes.resolve("codes", USERS) is None  # not deployed: not an adapter name yet
    alias = run(routes.deploy("codes", None, None, None))
    assert alias.stable == 2 and alias.roles == ["user", "admin"]
    assert routes.upstreams.loaded == {"codes-v2"}  # type: ignore[attr-defined]
    assert served(routes) == "codes-v2"
    assert routes.visible(USERS) == [{"id": "codes", "object": "model", "owned_by": "appliance",
                                      "parent": "base-model"}]
    assert routes.registry().find("codes", 2).state == "deployed"
    assert (routes.home.root / "adapters" / "codes" / "v2" / "adapter_model.safetensors").read_bytes() == b"weights"


def test_each_change_tells_the_response_cache_which_name_changed(routes: AdapterRoutes) -> None:
    """Deploy, canary, rollback and retire drop the cached answers given under the name."""
    changed: list[str] = []
    routes.on_change = changed.append
    run(routes.deploy("codes", 1, None, None))
    run(routes.canary("codes", 2, 0.5))
    run(routes.rollback("codes"))
    run(routes.retire("codes", 2))
    assert changed == ["codes"] * 4
    with pytest.raises(ApplianceError):
        run(routes.canary("codes", 3, 0.5))  # refused: nothing changed, nothing dropped
    assert changed == ["codes"] * 4


def test_roles_limit_who_may_call_an_adapter(routes: AdapterRoutes) -> None:
    run(routes.deploy("codes", 1, None, [Role.ADMIN]))
    with pytest.raises(GatewayError, match="not available to your roles") as refused:
        routes.resolve("codes", USERS)
    assert refused.value.status == 403
    assert routes.visible(USERS) == [] and routes.visible(frozenset({"admin"}))[0]["id"] == "codes"


def test_an_adapter_on_a_pool_no_longer_configured_is_not_listed_and_says_so(routes: AdapterRoutes) -> None:
    run(routes.deploy("codes", 1, None, None))
    routes.upstreams.pools = []  # type: ignore[misc]  # the pool was removed from the settings
    assert routes.visible(USERS) == []
    with pytest.raises(GatewayError, match="no engine pool named 'main'"):
        routes.resolve("codes", USERS)


def test_canary_splits_requests_by_share(routes: AdapterRoutes) -> None:
    run(routes.deploy("codes", 1, None, None))
    alias = run(routes.canary("codes", 2, 0.25))
    assert (alias.stable, alias.canary, alias.canary_share) == (1, 2, 0.25)
    counts = Counter(served(routes) for _ in range(4000))
    assert 0.2 < counts["codes-v2"] / 4000 < 0.3 and counts["codes-v1"] + counts["codes-v2"] == 4000
    assert routes.registry().find("codes", 2).state == "canary"


def test_a_live_canary_shows_with_its_share_judged_or_not(routes: AdapterRoutes) -> None:
    """show-canary during a canary: the versions and the share; under analysis, the current window
    (begun when first asked, before the gateway's first tick) and its figures. 404 with none."""
    with pytest.raises(NotFound, match="'codes' is not deployed"):
        routes.canary_status("codes")
    run(routes.deploy("codes", 1, None, None))
    with pytest.raises(NotFound, match="'codes' has no canary"):
        routes.canary_status("codes")
    run(routes.canary("codes", 2, 0.25))
    assert routes.canary_status("codes") == {"stable": 1, "canary": 2, "canary_share": 0.25, "analysis": None}
    policy = CanaryAnalysis(window_s=60, windows=3)
    run(routes.canary("codes", 2, 0.5, policy))
    assert routes.canary_status("codes")["analysis"] is not None, "judged: its window begins when first asked"
    routes.canaries.served("codes", 2, "olga", "a", status=200, failed=False, latency_s=1.0, ttft_s=None)
    status = routes.canary_status("codes")
    assert (status["stable"], status["canary"], status["canary_share"]) == (1, 2, 0.5)
    window: Any = status["analysis"]
    assert (window["passed_windows"], window["policy"]["windows"]) == (0, 3) and 0 < window["window_left_s"] <= 60
    assert (window["canary_figures"]["requests"], window["stable_figures"]["requests"]) == (1, 0)
    run(routes.rollback("codes"))
    with pytest.raises(NotFound, match="'codes' has no canary"):
        routes.canary_status("codes")


def test_rollback_drops_the_canary_then_the_previous_version_then_serves_nothing(routes: AdapterRoutes) -> None:
    engine = routes.upstreams
    run(routes.deploy("codes", 1, None, None))
    run(routes.deploy("codes", 2, None, None))
    assert engine.loaded == {"codes-v1", "codes-v2"} and routes.registry().aliases["codes"].history == [1]
    run(routes.canary("codes", 1, 0.5))
    assert run(routes.rollback("codes")).canary is None  # the canary goes first
    assert run(routes.rollback("codes")).stable == 1
    assert served(routes) == "codes-v1" and "codes-v2" not in engine.loaded
    assert [r.state for r in routes.registry().versions("codes")] == ["deployed", "registered", "failed-gate"]
    alias = run(routes.rollback("codes"))
    assert alias.stable is None and engine.loaded == set()
    refused = refusal(routes.rollback("codes"))
    assert refused.status == 409 and "'codes' has no version deployed" in refused.message
    assert "nothing to roll back" in refused.message and "`appliance adapters deploy codes`" in refused.message


def test_a_name_rolled_back_past_its_first_version_is_refused_never_the_base(routes: AdapterRoutes) -> None:
    """A client that asked for an adapter gets the adapter or an error, never the base model's answer."""
    run(routes.deploy("codes", 1, None, None))
    run(routes.rollback("codes"))
    with pytest.raises(GatewayError) as refused:
        routes.resolve("codes", USERS)
    error = refused.value
    assert (error.status, error.code, error.param, error.type) == (409, "adapter_not_deployed", "model",
                                                                   "invalid_request_error")
    assert "adapter 'codes' has no version deployed" in error.message
    assert "deploy one with `appliance adapters deploy codes`" in error.message
    assert routes.visible(USERS) == [] and routes.visible(frozenset({"admin"})) == []  # not callable: not listed
    with pytest.raises(GatewayError, match="not available to your roles"):
        routes.resolve("codes", frozenset({"auditor"}))  # roles are checked first: nothing else is told
    canary = refusal(routes.canary("codes", 2, 0.5))
    assert canary.status == 409 and "a canary needs a stable version" in canary.message
    run(routes.deploy("codes", 2, None, None))  # deployed again: served, listed, with its pool and roles
    assert served(routes) == "codes-v2" and [entry["id"] for entry in routes.visible(USERS)] == ["codes"]


def test_refusals_name_the_problem_and_change_nothing(routes: AdapterRoutes) -> None:
    before = adapters.registry_path(routes.home).read_text()
    for call, status, message in [
        (routes.deploy("codes", 3, None, None), 409, "v3 is failed-gate"),
        (routes.deploy("codes", 9, None, None), 404, "has no version 9"),
        (routes.deploy("nope", None, None, None), 404, "no adapter named 'nope'"),
        (routes.deploy("codes", 1, "other", None), 404, "no engine pool named 'other'"),
        (routes.canary("codes", 2, 0.1), 404, "'codes' is not deployed"),
        (routes.rollback("codes"), 404, "'codes' is not deployed"),
    ]:
        refused = refusal(call)
        assert refused.status == status and re.search(message, refused.message), refused.message
    routes.base_configs["main"] = "another-model"
    mismatch = refusal(routes.deploy("codes", 1, None, None))
    assert (mismatch.status, mismatch.code) == (409, "base_mismatch")
    assert "was trained on demo, not on the model pool 'main' serves" in mismatch.message
    routes.base_configs["main"] = "base"
    routes.upstreams.lora = False  # type: ignore[attr-defined]
    with pytest.raises(GatewayError, match="does not serve adapters .*enable_lora = true"):
        run(routes.deploy("codes", 1, None, None))
    assert adapters.registry_path(routes.home).read_text() == before


def test_retire_a_version_or_the_whole_name(routes: AdapterRoutes) -> None:
    run(routes.deploy("codes", 1, None, None))
    run(routes.deploy("codes", 2, None, None))
    refused = refusal(routes.retire("codes", 2))
    assert refused.status == 409 and "v2 is being served" in refused.message
    [retired] = run(routes.retire("codes", 1))
    assert retired.state == "retired" and routes.registry().aliases["codes"].history == []
    run(routes.retire("codes", None))
    assert routes.resolve("codes", USERS) is None and routes.upstreams.loaded == set()  # type: ignore[attr-defined]
    assert {r.state for r in routes.registry().versions("codes")} == {"retired"}


def test_retiring_an_unknown_adapter_is_a_404(routes: AdapterRoutes) -> None:
    for version in (None, 7):
        assert refusal(routes.retire("nope" if version is None else "codes", version)).status == 404


def test_a_version_whose_files_changed_in_the_store_is_not_deployed(tmp_path: Path, home: Home) -> None:
    """Adapter files are re-hashed against the digests recorded at registration."""
    import hashlib

    store = LocalStore(tmp_path / "store")
    artifact = "adapters/codes/v1/"
    files = {"adapter_config.json": b"{}", "adapter_model.safetensors": b"weights"}
    for name, data in files.items():
        store.put(artifact + name, data, retain_days=0)
    with adapters.updating(home) as registry:
        registry.adapters.append(AdapterRecord(
            name="codes", version=1, base_model="demo", base_config_sha256="base", dataset="d", dataset_sha256="x",
            hyperparameters=Hyperparameters(), metrics=metrics(), artifact=artifact, state="registered",
            files={name: hashlib.sha256(data).hexdigest() for name, data in files.items()}))
    (tmp_path / "store" / artifact / "adapter_model.safetensors").chmod(0o600)
    (tmp_path / "store" / artifact / "adapter_model.safetensors").write_bytes(b"backdoor")
    engine = Engine()
    routes = AdapterRoutes(home, engine, store, {"main": "base"})  # type: ignore[arg-type]
    caught = refusal(routes.deploy("codes", 1, None, None))
    assert caught.status == 409 and caught.code == "artifact_integrity"
    assert "'adapter_model.safetensors' in the artifact store is changed" in caught.message
    assert engine.loaded == set() and not (home.root / "adapters" / "codes" / "v1").exists()
    assert adapters.load(home).find("codes", 1).state == "registered", "nothing changed"


def test_every_adapter_move_is_checked_in_the_core(routes: AdapterRoutes) -> None:
    """The registry itself refuses a move its state machine forbids, whoever asks (API, CLI, TUI)."""
    registry = routes.registry()
    with pytest.raises(IllegalTransition, match="codes v3 is failed-gate: it cannot become canary"):
        registry.move("codes", 3, AdapterState.CANARY)
    registry.move("codes", 1, AdapterState.RETIRED)
    for state in (AdapterState.REGISTERED, AdapterState.DEPLOYED, AdapterState.CANARY):
        with pytest.raises(IllegalTransition, match=f"codes v1 is retired: it cannot become {state}"):
            registry.move("codes", 1, state)
    assert set(MOVES) == set(AdapterState) and not MOVES[AdapterState.RETIRED]


def test_the_rules_of_each_change_are_the_registry_s(routes: AdapterRoutes) -> None:
    """Deploy, canary, rollback and retire are rules of the core's Registry: they check and move
    states and say what the engine must load and unload; no engine is asked."""
    registry = routes.registry().model_copy(deep=True)
    deployed = registry.deploy("codes", None, "main", None)
    assert deployed.load is not None and deployed.load.version == 2 and deployed.unload == ()
    assert registry.alias("codes").stable == 2 and registry.find("codes", 2).state == AdapterState.DEPLOYED
    canary = registry.canary("codes", 1, 0.5)
    assert canary.load is not None and canary.load.version == 1
    with pytest.raises(Conflict, match="v2 is already the stable version"):
        registry.canary("codes", 2, 0.5)
    dropped = registry.rollback("codes")
    assert dropped.load is None and [r.version for r in dropped.unload] == [1]
    to_none = registry.rollback("codes")  # no version before v2: none (not the base model)
    assert to_none.load is None and [r.version for r in to_none.unload] == [2]
    assert registry.alias("codes").stable is None
    with pytest.raises(Conflict, match="'codes' has no version deployed .*: nothing to roll back"):
        registry.rollback("codes")
    with pytest.raises(NotFound, match="'other' is not deployed"):
        registry.rollback("other")
    retired = registry.retire("codes", None)
    assert retired.pool == "main" and {r.state for r in retired.unload} == {AdapterState.RETIRED}
    assert "codes" not in registry.aliases
    assert routes.upstreams.loaded == set()  # type: ignore[attr-defined]
    assert routes.registry().find("codes", 2).state == AdapterState.REGISTERED, "a copy: nothing written"


def test_an_adapter_whose_pool_was_removed_can_still_be_retired(routes: AdapterRoutes) -> None:
    run(routes.deploy("codes", 1, None, None))
    routes.upstreams.pools = []  # type: ignore[misc]  # the pool was removed from the settings
    retired = run(routes.retire("codes", None))
    assert {r.state for r in retired} == {AdapterState.RETIRED} and "codes" not in routes.registry().aliases


def test_retiring_from_the_history_leaves_every_rollback_a_change(routes: AdapterRoutes) -> None:
    registry = routes.registry().model_copy(deep=True)
    for version in (1, 2, 1, 2):  # history [1, 2, 1], v2 served
        registry.deploy("codes", version, "main", None)
    assert registry.alias("codes").history == [1, 2, 1]
    registry.retire("codes", 1)  # [2] would follow v2 itself: gone too
    assert registry.alias("codes").history == []
    assert registry.rollback("codes").unload[0].version == 2 and registry.alias("codes").stable is None


def test_a_deploy_that_would_serve_another_version_than_it_loaded_is_refused(routes: AdapterRoutes) -> None:
    """The trainer registers a newer version while the engine loads "the newest": nothing is written."""
    engine = routes.upstreams
    loading = engine.engine_post  # type: ignore[attr-defined]

    async def load_while_registering(pool: Pool, path: str, body: dict) -> tuple[int, str]:
        with adapters.updating(routes.home) as registry:
            newest = registry.find("codes", 2).model_copy(update={"version": 4})
            registry.adapters.append(newest)
        return await loading(pool, path, body)

    engine.engine_post = load_while_registering  # type: ignore[attr-defined]
    refused = refusal(routes.deploy("codes", None, None, None))
    assert refused.status == 409 and "changed while the engine loaded" in refused.message
    assert "codes" not in routes.registry().aliases and routes.registry().find("codes", 2).state == "registered"


def test_requests_finding_a_version_unloaded_at_once_each_get_its_files(routes: AdapterRoutes) -> None:
    """The first requests for a version the engine has not loaded (a policy version just trained, an
    engine restarted) copy its files at the same time: each gets them, and no partial copy is left."""
    record = routes.registry().find("codes", 2)
    barrier = threading.Barrier(8)
    get = routes.store.get

    def slow_get(key: str) -> bytes:
        barrier.wait(timeout=10)  # every request is past its look for the files before any writes them
        return get(key)

    routes.store.get = slow_get  # type: ignore[method-assign]
    with ThreadPoolExecutor(8) as threads:
        found = list(threads.map(lambda _: routes._materialize(record), range(8)))
    assert len(set(found)) == 1 and (found[0] / "adapter_model.safetensors").read_bytes() == b"weights"
    assert sorted(p.name for p in found[0].parent.iterdir()) == ["v2"]
    # The engine, the gateway's own user, reads them: no one else does (whatever the process's umask).
    modes = {path.relative_to(routes.home.root).as_posix(): stat.S_IMODE(path.stat().st_mode)
             for path in [found[0].parent.parent, found[0].parent, found[0], *found[0].iterdir()]}
    assert modes == {"adapters": 0o700, "adapters/codes": 0o700, "adapters/codes/v2": 0o700,
                     **{f"adapters/codes/v2/{p.name}": 0o600 for p in found[0].iterdir()}}


def test_a_request_refused_for_a_name_serving_nothing_is_audited_under_the_name(routes: AdapterRoutes,
                                                                                 tmp_path: Path) -> None:
    """The relay's record of the refusal names the adapter asked for (not the base model)."""
    run(routes.deploy("codes", 1, None, None))
    run(routes.rollback("codes"))
    gateway = SimpleNamespace(adapters=routes)

    async def chat(scope: dict, receive: Any, send: Any) -> None:
        scope["app"] = SimpleNamespace(state=SimpleNamespace(gateway=gateway))
        context_of(Request(scope)).principal = through_gateway.ALICE
        try:
            await relay(Request(scope, receive), through_gateway.ALICE, "/v1/chat/completions",
                        ChatRequest(model="codes", messages=[{"role": "user", "content": "hi"}]))
        except GatewayError as exc:
            await exc.response()(scope, receive, send)

    stack, _ = through_gateway.gateway_stack(chat, AuditWriter(tmp_path / "audit", Ed25519PrivateKey.generate()))
    _, sent = through_gateway.call(stack)
    assert sent[0]["status"] == 409 and b"adapter_not_deployed" in sent[1]["body"]
    [record] = read_records(tmp_path / "audit")
    assert (record["model"], record["status"], record["reason"]) == ("codes", 409, "adapter_not_deployed")
