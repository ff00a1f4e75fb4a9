"""/admin/datasets (role `admin`): the training datasets, as `appliance data list`, `show` and
`remove` see them (appliance.datasets). A name in the path is checked against the dataset name rule
before anything is read with it."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request

from appliance import datasets
from appliance.artifacts import artifact_store
from appliance.home import Home
from appliance.settings import Settings
from serve.audit_trail import MONITORING, REFRESHED, note_target
from serve.deps import requires

# Longer than any good name (64): the rule's own message refuses those, and this bounds what is echoed.
DatasetName = Annotated[str, Path(max_length=200)]


class Removed(datasets.Entry):
    """A dataset removed: its name, the version it trained on, and the stored versions deleted
    (those no other name used)."""

    deleted: list[str]


def router(settings: Settings, home: Home) -> APIRouter:
    routes = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(requires("admin"))])

    @routes.get("/datasets", response_model=list[datasets.Entry], name="datasets.list", openapi_extra=MONITORING)
    def list_datasets() -> list[datasets.Entry]:
        """Datasets by name, each with the SHA-256 of the version it trains on."""
        return datasets.listing(home)

    @routes.get("/datasets/{name}", response_model=datasets.Dataset, name="datasets.read", openapi_extra=REFRESHED)
    def show_dataset(request: Request, name: DatasetName) -> datasets.Dataset:
        """A dataset's versions, the one in use first, their rows and what their checks found; the
        files of the version in use are checked against its digest first (changed: 409
        `artifact_integrity`). No such dataset: 404."""
        note_target(request, "dataset", name)
        datasets.check_name(name)
        return datasets.show(home, artifact_store(settings.artifacts, home), name)

    @routes.delete("/datasets/{name}", response_model=Removed, name="datasets.remove")
    def remove_dataset(request: Request, name: DatasetName) -> Removed:
        """Forget a dataset and delete its stored versions that no other name uses. Refused (409)
        while a queued or running training job uses it; no such dataset: 404."""
        note_target(request, "dataset", name)
        datasets.check_name(name)
        digest = datasets.load_registry(home).get(name, "")
        deleted = datasets.remove(home, artifact_store(settings.artifacts, home), name)
        return Removed(name=name, sha256=digest, deleted=deleted)

    return routes
