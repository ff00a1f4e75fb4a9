"""The adapter registry, shared by the trainer (which registers versions) and the gateway (which
deploys them and routes to them): versioned adapter records (DESIGN.md) and, per adapter name,
what is served under that name: a stable version (or, after a rollback past the first version,
none: requests for the name are refused, never answered by the base model), optionally a canary
version taking a share of the requests, and the versions served before (for rollback). One JSON
file in the state dir (appliance.registry: changed under an exclusive lock and replaced
atomically), so the trainer and the gateway never lose each other's changes.

The rules of deploy, canary, rollback and retire are the Registry's methods: each checks its
moves and changes the registry, and returns the ServingChange the engine needs (what to load
before the change is written, what to unload after). The gateway runs a change on a copy first
(nothing is asked of an engine for a change the rules refuse), then for real under the lock.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, computed_field, model_validator

from appliance.canary import CanaryAnalysis
from appliance.errors import Conflict, IllegalTransition, IntegrityError, NotFound
from appliance.home import Home
from appliance.jobs import Hyperparameters
from appliance.registry import JsonRegistry
from appliance.roles import Role

DEFAULT_ROLES = [Role.USER, Role.ADMIN]  # who may call a newly deployed name


class AdapterState(StrEnum):
    r"""Where a version is in its life:

        registered --deploy--> deployed --(replaced, rolled back)--> registered
            |  \--canary--> canary --(deploy)--> deployed; --(rollback, replaced)--> registered
            +--retire--> retired <--retire (the whole name)-- deployed | canary | failed-gate
        failed-gate (the evaluation gate refused it) is never served.
    """

    REGISTERED = "registered"
    FAILED_GATE = "failed-gate"
    DEPLOYED = "deployed"
    CANARY = "canary"
    RETIRED = "retired"


MOVES: dict[AdapterState, frozenset[AdapterState]] = {
    AdapterState.REGISTERED: frozenset({AdapterState.DEPLOYED, AdapterState.CANARY, AdapterState.RETIRED}),
    AdapterState.DEPLOYED: frozenset({AdapterState.REGISTERED, AdapterState.RETIRED}),
    AdapterState.CANARY: frozenset({AdapterState.DEPLOYED, AdapterState.REGISTERED, AdapterState.RETIRED}),
    AdapterState.FAILED_GATE: frozenset({AdapterState.RETIRED}),
    AdapterState.RETIRED: frozenset(),
}


class Scores(BaseModel):
    """An evaluation set's score (fraction right) for the base model and with the adapter: the
    mean over the seeds the set was answered with (the gate judges it), each seed's score and
    their spread (the sample standard deviation)."""

    # Fractions of a set, never NaN: a registry must always read back (the gateway reads it on each request).
    model_config = ConfigDict(allow_inf_nan=False)

    base: float = Field(ge=0, le=1)
    adapter: float = Field(ge=0, le=1)
    # Empty: scored once, before seeds were kept. At most 20 seeds (finetune.gate_seeds).
    base_per_seed: list[Annotated[float, Field(ge=0, le=1)]] = Field([], max_length=20)
    adapter_per_seed: list[Annotated[float, Field(ge=0, le=1)]] = Field([], max_length=20)
    shipped: bool = False  # the appliance's own regression set: the operator brought none
    # The adapter's score less the base's: its 95 % interval (a bootstrap paired by task), where measured.
    difference_95: tuple[Annotated[float, Field(ge=-1, le=1)], Annotated[float, Field(ge=-1, le=1)]] | None = None

    @classmethod
    def over_seeds(cls, base: list[float], adapter: list[float], *, shipped: bool = False) -> Scores:
        """From each seed's scores (as many for the base as for the adapter, at least one each;
        ValueError otherwise, or for a score that is not a fraction)."""
        if not base or len(base) != len(adapter):
            raise ValueError(f"{len(base)} base and {len(adapter)} adapter scores: one of each per seed")
        if not all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and 0 <= x <= 1
                   for x in (*base, *adapter)):
            raise ValueError("a score is not a fraction between 0 and 1")
        return cls(base=statistics.fmean(base), adapter=statistics.fmean(adapter), base_per_seed=base,
                   adapter_per_seed=adapter, shipped=shipped)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def base_spread(self) -> float:
        return _spread(self.base_per_seed)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def adapter_spread(self) -> float:
        return _spread(self.adapter_per_seed)

    def line(self, kind: str) -> str:
        """`regression (shipped) 80% -> 75% (mean of 3 seeds, +/- 4%)`, and the difference's interval
        where it was measured."""
        interval = "" if self.difference_95 is None else \
            f", difference 95% [{self.difference_95[0]:+.0%}, {self.difference_95[1]:+.0%}]"
        return (f"{kind}{' (shipped)' if self.shipped else ''} {self.base:.0%} -> {self.adapter:.0%}"
                f"{self.spread_note()}{interval}")

    def spread_note(self) -> str:
        """` (mean of 3 seeds, +/- 4%)`: the adapter's spread; nothing for one score."""
        seeds = len(self.adapter_per_seed)
        return f" (mean of {seeds} seeds, +/- {self.adapter_spread:.0%})" if seeds > 1 else ""


def _spread(scores: list[float]) -> float:
    return statistics.stdev(scores) if len(scores) > 1 else 0.0


class AdapterMetrics(BaseModel):
    """How the version was trained and how it did on the evaluation gate."""

    # A diverged run's NaN loss travels as "NaN" (valid JSON that reads back), never as null.
    model_config = ConfigDict(ser_json_inf_nan="strings")

    base_eval_loss: float
    adapter_eval_loss: float
    improvement: float  # relative drop of held-out loss (0.1: 10 % lower than the base)
    steps: int
    train_tokens: int
    seconds: float
    resumed_from: str | None = None  # the checkpoint training resumed from
    eval_sets: dict[str, Scores] = {}  # kind (scenarios, regression) -> scores
    processes: int = 1  # DDP processes that trained it
    gate_failures: list[str] = []  # why it failed the gate; empty: it passed


class AdapterRecord(BaseModel):
    name: str
    version: int
    base_model: str
    base_config_sha256: str
    dataset: str
    dataset_sha256: str
    hyperparameters: Hyperparameters
    metrics: AdapterMetrics
    artifact: str  # the key prefix of its files in the artifact store
    files: dict[str, str] = {}  # file name -> SHA-256, checked whenever the files are read back
    state: AdapterState
    created: str = Field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))

    @property
    def engine_name(self) -> str:
        """The name vLLM serves this version under (clients use the adapter's name)."""
        return engine_name(self.name, self.version)


class Alias(BaseModel):
    """What requests for an adapter's name get."""

    pool: str
    roles: list[Role]  # realm roles allowed to call it
    stable: int | None  # the version served; None: none (rolled back past the first), requests refused
    canary: int | None = None
    canary_share: float = Field(0.0, ge=0, le=1)
    canary_analysis: CanaryAnalysis | None = None  # None: the canary is promoted or dropped by hand
    history: list[int] = []  # versions served before `stable`, oldest first


class Registry(BaseModel):
    adapters: list[AdapterRecord] = []
    aliases: dict[str, Alias] = {}

    @model_validator(mode="before")
    @classmethod
    def _from_list(cls, data: Any) -> Any:
        """Before aliases existed the file was the list of records."""
        return {"adapters": data} if isinstance(data, list) else data

    def versions(self, name: str) -> list[AdapterRecord]:
        return [record for record in self.adapters if record.name == name]

    def move(self, name: str, version: int, to: AdapterState) -> AdapterRecord:
        """Set a version's state, as MOVES allows (staying put is always allowed); IllegalTransition
        naming the version, its state and the move otherwise."""
        record = self.find(name, version)
        check_move(record, to)
        record.state = to
        return record

    def find(self, name: str, version: int | None = None) -> AdapterRecord:
        """A version of `name`, or (version None) its newest version that passed the gate."""
        versions = self.versions(name)
        if not versions:
            raise NotFound(f"no adapter named {name!r}",
                                 hint=f"adapters: {sorted({r.name for r in self.adapters}) or 'none'}")
        if version is None:
            passed = [r for r in versions if r.state not in (AdapterState.FAILED_GATE, AdapterState.RETIRED)]
            if not passed:
                raise NotFound(f"adapter {name!r} has no version that passed its evaluation gate")
            return max(passed, key=lambda r: r.version)
        for record in versions:
            if record.version == version:
                return record
        raise NotFound(f"adapter {name!r} has no version {version}",
                             hint=f"versions: {[r.version for r in versions]}")

    # -- what a name serves: the rules of each change ----------------------------------------

    def alias(self, name: str) -> Alias:
        """What `name` serves; NotFound if it is not deployed."""
        alias = self.aliases.get(name)
        if alias is None:
            raise NotFound(f"adapter {name!r} is not deployed")
        return alias

    def deploy(self, name: str, version: int | None, pool: str, roles: list[Role] | None) -> ServingChange:
        """Serve `version` (None: the newest that passed its gate) under `name`, all requests, on
        `pool` for `roles` (None: the roles it has, else DEFAULT_ROLES). The version served
        before goes to the history (for rollback); a canary ends."""
        record = self.find(name, version)
        check_move(record, AdapterState.DEPLOYED)
        alias = self.aliases.get(name) or Alias(pool=pool, roles=roles or DEFAULT_ROLES, stable=None)
        if alias.stable is not None and alias.stable != record.version:
            alias.history.append(alias.stable)
            self.move(name, alias.stable, AdapterState.REGISTERED)
        if alias.canary is not None and alias.canary != record.version:
            self.move(name, alias.canary, AdapterState.REGISTERED)
        alias.pool, alias.roles = pool, roles or alias.roles
        alias.stable, alias.canary, alias.canary_share, alias.canary_analysis = record.version, None, 0.0, None
        self.move(name, record.version, AdapterState.DEPLOYED)
        self.aliases[name] = alias
        return ServingChange(pool=pool, load=record)

    def canary(self, name: str, version: int, share: float, analysis: CanaryAnalysis | None = None) -> ServingChange:
        """Send `share` of the requests for `name` to `version`, the rest to the stable version;
        with `analysis`, the gateway promotes or aborts it by its numbers (appliance.canary)."""
        alias = self.alias(name)
        if version == alias.stable:
            raise Conflict(f"{name} v{version} is already the stable version")
        if alias.stable is None:
            raise Conflict(not_deployed(name, "a canary needs a stable version to take the rest of the requests"))
        record = self.find(name, version)
        check_move(record, AdapterState.CANARY)
        if alias.canary is not None and alias.canary != version:
            self.move(name, alias.canary, AdapterState.REGISTERED)
        alias.canary, alias.canary_share, alias.canary_analysis = version, share, analysis
        self.move(name, version, AdapterState.CANARY)
        return ServingChange(pool=alias.pool, load=record)

    def rollback(self, name: str) -> ServingChange:
        """Drop the canary if there is one; else serve the version served before (or, past the
        first, none: the name is refused until a version is deployed again)."""
        alias = self.alias(name)
        if alias.canary is not None:
            dropped = self.move(name, alias.canary, AdapterState.REGISTERED)
            alias.canary, alias.canary_share, alias.canary_analysis = None, 0.0, None
            return ServingChange(pool=alias.pool, unload=(dropped,))
        if alias.stable is None:
            raise Conflict(not_deployed(name, "nothing to roll back"))
        dropped = self.move(name, alias.stable, AdapterState.REGISTERED)
        alias.stable = alias.history.pop() if alias.history else None
        if alias.stable is None:
            return ServingChange(pool=alias.pool, unload=(dropped,))
        restored = self.move(name, alias.stable, AdapterState.DEPLOYED)
        return ServingChange(pool=alias.pool, load=restored, unload=(dropped,))

    def retire(self, name: str, version: int | None) -> ServingChange:
        """Retire one version (not while it is served), or (no version) the name: every version
        retired, the name no longer served."""
        alias = self.aliases.get(name)
        targets = [self.find(name, version)] if version is not None else self.versions(name)
        if not targets:
            self.find(name, None)  # raises: no such adapter
        if version is not None and alias is not None and version in (alias.stable, alias.canary):
            raise Conflict(f"{name} v{version} is being served; deploy another version or roll back first")
        if version is None:
            self.aliases.pop(name, None)
        elif alias is not None:
            alias.history = _history_without(alias.history, version, alias.stable)
        retired = tuple(self.move(name, record.version, AdapterState.RETIRED) for record in targets)
        return ServingChange(pool=alias.pool if alias is not None else None, unload=retired)


def deploy_pool(alias: Alias | None, pools: list[str]) -> str | None:
    """The pool a deploy that names none serves a name on: the one it is served on, else the first."""
    return alias.pool if alias is not None else next(iter(pools), None)


def not_deployed(name: str, consequence: str) -> str:
    """The refusal for a name rolled back past its first version (it serves nothing): what that
    means here, and how to serve it again."""
    return (f"adapter {name!r} has no version deployed (it was rolled back past its first): {consequence}; "
            f"deploy one with `appliance adapters deploy {name}`")


def _history_without(history: list[int], version: int, stable: int | None) -> list[int]:
    """`history` with every entry of `version` gone and no version following itself (nor the
    stable one following its own last entry): each rollback then changes what is served."""
    kept: list[int] = []
    for entry in history:
        if entry != version and (not kept or kept[-1] != entry):
            kept.append(entry)
    if kept and kept[-1] == stable:
        kept.pop()
    return kept


@dataclass(frozen=True)
class ServingChange:
    """What a change to what a name serves needs from its pool's engine: `load` before the change
    is written (no request may find it missing), `unload` after (None pool: no engine holds them)."""

    pool: str | None
    load: AdapterRecord | None = None
    unload: tuple[AdapterRecord, ...] = ()


class BaseMismatch(Conflict):
    """An adapter asked to be served on a pool whose model it was not trained on."""

    code = "base_mismatch"


def check_base(record: AdapterRecord, pool: str, model: str, served_config_sha256: str | None) -> None:
    """BaseMismatch unless the pool serves the model `record` was trained on (None: unknown)."""
    if served_config_sha256 is not None and served_config_sha256 != record.base_config_sha256:
        raise BaseMismatch(f"{record.name} v{record.version} was trained on {record.base_model}, not on the model "
                           f"pool {pool!r} serves ({model})")


def check_move(record: AdapterRecord, to: AdapterState) -> None:
    """IllegalTransition unless MOVES lets `record` become `to` (staying put is always allowed)."""
    if to != record.state and to not in MOVES[record.state]:
        raise IllegalTransition(f"{record.name} v{record.version} is {record.state}: it cannot become {to}")


def engine_name(name: str, version: int) -> str:
    return f"{name}-v{version}"


def registry_path(home: Home) -> Path:
    return home.root / "adapters.json"


def _registry(home: Home) -> JsonRegistry[Registry]:
    return JsonRegistry(registry_path(home), Registry, "the adapter registry")


def load(home: Home) -> Registry:
    return _registry(home).read()


def updating(home: Home) -> AbstractContextManager[Registry]:
    """The registry to change in the block; written back (atomically) only if the block succeeds."""
    return _registry(home).change()


def check_files(record: AdapterRecord, files: dict[str, bytes]) -> None:
    """Raise IntegrityError unless `files` (name -> content, as read back from the store) are
    exactly the files recorded for the version, byte for byte."""
    if not record.files:
        return  # registered before digests were recorded: nothing to check against
    found = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    for name in sorted(set(record.files) | set(found)):
        if record.files.get(name) != found.get(name):
            what = "missing" if name not in found else "not recorded" if name not in record.files else "changed"
            raise IntegrityError(f"{record.name} v{record.version}: file {name!r} in the artifact store is {what} "
                                 "since the version was registered", hint="retire this version and train it again")
