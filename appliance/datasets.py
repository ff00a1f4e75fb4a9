"""Training datasets as the appliance records them: the registry of names (datasets.json: each name
and the digest the version it trains on is stored under), each stored version's record (its
meta.json beside its files in the artifact store), reading them back, checking the files in use
against their digest, and removing a dataset. The CLI, the training runner and the admin API read
them here; finetune.datasets checks, scans, splits and stores new versions."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from appliance import jobs
from appliance.artifacts import ArtifactStore
from appliance.errors import Conflict, IntegrityError, Invalid, NotFound
from appliance.home import Home
from appliance.registry import JsonRegistry

PREFIX = "datasets/"  # in the artifact store: datasets/<sha256>/{train,eval}.jsonl and meta.json


class Entry(BaseModel):
    """A named dataset and the digest of the version it trains on."""

    model_config = ConfigDict(frozen=True)

    name: str
    sha256: str


class Version(BaseModel):
    """One stored version of a named dataset, as its meta.json records it."""

    model_config = ConfigDict(frozen=True)

    sha256: str
    current: bool  # the version the name trains on now
    created: str
    source: str
    kind: str | None  # SFT rows or preference rows (None: stored before it was recorded)
    rows: int
    train: int
    eval: int
    sensitive: dict[str, int]
    sensitive_action: str


class Dataset(BaseModel):
    """A named dataset's versions, newest first (the one in use first)."""

    name: str
    versions: list[Version]


def check_name(name: str) -> None:
    """Invalid unless `name` may name a dataset (the rule adapters' names follow too)."""
    if problem := jobs.name_problem(name):
        raise Invalid(f"dataset name {name[:80]!r}: {problem}")


def content_digest(train: bytes, evaluation: bytes) -> str:
    """A dataset's identity: SHA-256 of its train and eval files."""
    return hashlib.sha256(train + b"\0" + evaluation).hexdigest()


def check_dataset(name: str, digest: str, train: bytes, evaluation: bytes) -> None:
    """Raise IntegrityError unless the files read back from the store are the dataset recorded."""
    found = content_digest(train, evaluation)
    if found != digest:
        raise IntegrityError(f"dataset {name!r} in the artifact store was changed since it was added "
                             f"(its files hash to {found[:16]}..., recorded {digest[:16]}...)",
                             hint=f"add the dataset again with `appliance data add FILE --name {name}`")


def _registry(home: Home) -> JsonRegistry[dict[str, str]]:
    return JsonRegistry(home.root / "datasets.json", dict[str, str], "the dataset registry")


def load_registry(home: Home) -> dict[str, str]:
    """Dataset names -> the digests their files are stored under."""
    return _registry(home).read()


def listing(home: Home) -> list[Entry]:
    """Every named dataset, by name."""
    return [Entry(name=name, sha256=digest) for name, digest in sorted(load_registry(home).items())]


def check_name_free(registry: dict[str, str], name: str, replace: bool) -> None:
    """Refuse to name a dataset `name` when one is so named, unless replacing it is asked for."""
    if name in registry and not replace:
        raise Conflict(f"a dataset named {name!r} exists (sha256 {registry[name][:16]}...)",
                       hint=f"add it with --replace to make this its new version, or choose another name; "
                            f"`appliance data show {name}` shows it")


def name_version(home: Home, name: str, digest: str, *, replace: bool) -> None:
    """Make the version stored under `digest` the one `name` trains on; a name already taken only
    with `replace` (its earlier versions stay in the store)."""
    with _registry(home).change() as registry:
        check_name_free(registry, name, replace)
        registry[name] = digest


def register(home: Home, names: dict[str, str]) -> None:
    """Name datasets (name -> digest) in the local registry, all in one change (the CLI and the
    rl-worker both add datasets)."""
    with _registry(home).change() as registry:
        registry.update(names)


def versions(home: Home, artifacts: ArtifactStore, name: str) -> list[Version]:
    """Every stored version of the dataset `name`, newest first; NotFound unless it is named."""
    registry = load_registry(home)
    if name not in registry:
        raise NotFound(f"no dataset named {name!r}", hint=f"datasets: {', '.join(sorted(registry)) or 'none'}")
    found = [_version(meta, registry[name]) for meta in _metas(artifacts) if meta.get("name") == name]
    return sorted(found, key=lambda version: (version.current, version.created), reverse=True)


def _metas(artifacts: ArtifactStore) -> list[dict[str, Any]]:
    return [json.loads(artifacts.get(key)) for key in artifacts.keys(PREFIX) if key.endswith("/meta.json")]


def _version(meta: dict[str, Any], current: str) -> Version:
    return Version(sha256=meta["sha256"], current=meta["sha256"] == current, created=meta["created"],
                   source=meta["source"], kind=meta.get("kind"), rows=meta["rows"], train=meta["train"],
                   eval=meta["eval"], sensitive=meta["sensitive"], sensitive_action=meta["sensitive_action"])


def verify_current(home: Home, artifacts: ArtifactStore, name: str) -> None:
    """IntegrityError unless the files of the version `name` trains on hash to its digest."""
    digest = load_registry(home)[name]
    check_dataset(name, digest, artifacts.get(f"{PREFIX}{digest}/train.jsonl"),
                  artifacts.get(f"{PREFIX}{digest}/eval.jsonl"))


def show(home: Home, artifacts: ArtifactStore, name: str) -> Dataset:
    """What `appliance data show` shows: the versions of `name`, once the files of the one in use
    are checked against its digest (IntegrityError if they changed)."""
    found = versions(home, artifacts, name)
    verify_current(home, artifacts, name)
    return Dataset(name=name, versions=found)


def remove(home: Home, artifacts: ArtifactStore, name: str) -> list[str]:
    """Forget the dataset `name` and delete the files of its versions that no other name uses;
    refused while a training job that has not ended uses it. The digests deleted."""
    stored = versions(home, artifacts, name)
    with _registry(home).change() as registry:
        if users := [str(job.id) for job in jobs.listing(home) if job.data == name and job.state not in jobs.FINISHED]:
            raise Conflict(f"dataset {name!r} is used by training job {', '.join(users)}, queued or running",
                           hint="wait until it ends, or `appliance finetune cancel JOB`")
        registry.pop(name, None)
        kept = set(registry.values())
    gone = [version.sha256 for version in stored if version.sha256 not in kept]
    for digest in gone:
        for key in artifacts.keys(f"{PREFIX}{digest}/"):
            artifacts.delete(key)
    return gone
