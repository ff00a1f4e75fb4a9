"""The records of stored datasets (appliance.datasets) and the admin API over them: list, show
(the files in use checked against their digest), remove (refused while a job that has not ended
uses it), each for administrators only, a path's name checked against the name rule first, and
the removal in the audit log with the dataset it removed."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from appliance import datasets, jobs
from appliance.artifacts import ArtifactStore, artifact_store
from appliance.errors import Conflict, IntegrityError, Invalid, NotFound
from appliance.home import Home
from appliance.settings import Settings
from audit import read_records
from tests.support.admin_api import Caller, admin_client


def put(artifacts: ArtifactStore, name: str, text: str, created: str = "2026-12-01T10:00:00+00:00") -> str:
    """A stored version of `name` as finetune.datasets stores one (one train row, one eval row)."""
    train, evaluation = f'{{"text":"{text}"}}\n'.encode(), f'{{"text":"{text}?"}}\n'.encode()
    digest = datasets.content_digest(train, evaluation)
    meta = {"name": name, "sha256": digest, "source": f"{name}.jsonl", "rows": 2, "kind": "SFT rows", "train": 1,
            "eval": 1, "sensitive": {"email": 1}, "sensitive_action": "redact", "created": created}
    for key, data in (("train.jsonl", train), ("eval.jsonl", evaluation), ("meta.json", json.dumps(meta).encode())):
        artifacts.put(f"{datasets.PREFIX}{digest}/{key}", data, retain_days=0)
    return digest


@pytest.fixture
def artifacts(home: Home) -> ArtifactStore:
    return artifact_store(Settings().artifacts, home)


def test_a_named_version_is_listed_and_shown_newest_first(home: Home, artifacts: ArtifactStore) -> None:
    first = put(artifacts, "faq", "one", "2026-12-01T10:00:00+00:00")
    datasets.name_version(home, "faq", first, replace=False)
    second = put(artifacts, "faq", "two", "2026-12-02T10:00:00+00:00")
    with pytest.raises(Conflict, match="a dataset named 'faq' exists"):
        datasets.name_version(home, "faq", second, replace=False)
    datasets.name_version(home, "faq", second, replace=True)
    datasets.register(home, {"copy": first})
    assert datasets.listing(home) == [datasets.Entry(name="copy", sha256=first),
                                      datasets.Entry(name="faq", sha256=second)]
    shown = datasets.show(home, artifacts, "faq")
    assert [(v.sha256, v.current, v.rows, v.kind, v.sensitive) for v in shown.versions] == [
        (second, True, 2, "SFT rows", {"email": 1}), (first, False, 2, "SFT rows", {"email": 1})]
    with pytest.raises(NotFound, match="no dataset named 'other'") as caught:
        datasets.show(home, artifacts, "other")
    assert caught.value.hint == "datasets: copy, faq"


def test_show_refuses_a_version_whose_files_changed(home: Home, artifacts: ArtifactStore) -> None:
    digest = put(artifacts, "faq", "one")
    datasets.register(home, {"faq": digest})
    artifacts.put(f"{datasets.PREFIX}{digest}/train.jsonl", b'{"text":"other"}\n', retain_days=0)
    with pytest.raises(IntegrityError, match="dataset 'faq' in the artifact store was changed"):
        datasets.show(home, artifacts, "faq")


@pytest.mark.parametrize("name", ["..", "Faq", "a/b", "-x", "x" * 65, "faq\n", "<script>"])
def test_a_name_outside_the_rule_is_refused(name: str) -> None:
    with pytest.raises(Invalid, match="dataset name .*: use lower-case letters"):
        datasets.check_name(name)
    datasets.check_name("faq-2.v1_x")


# -- /admin/datasets ---------------------------------------------------------------------------


@pytest.fixture
def api_client(home: Home) -> tuple[TestClient, Caller]:
    return admin_client(home)


def test_the_api_lists_shows_and_removes_as_the_cli_does(home: Home, artifacts: ArtifactStore,
                                                         api_client: tuple[TestClient, Caller]) -> None:
    client, _ = api_client
    digest = put(artifacts, "faq", "one")
    datasets.register(home, {"faq": digest})
    listed = client.get("/admin/datasets")
    assert listed.status_code == 200 and listed.json() == [{"name": "faq", "sha256": digest}]
    shown = client.get("/admin/datasets/faq")
    assert shown.status_code == 200, shown.text
    assert shown.json()["name"] == "faq" and [v["sha256"] for v in shown.json()["versions"]] == [digest]
    assert shown.json()["versions"][0] | {"sha256": ""} == {
        "sha256": "", "current": True, "created": "2026-12-01T10:00:00+00:00", "source": "faq.jsonl",
        "kind": "SFT rows", "rows": 2, "train": 1, "eval": 1, "sensitive": {"email": 1}, "sensitive_action": "redact"}
    job = jobs.submit(home, name="bot", data="faq", base="demo", hyperparameters=jobs.Hyperparameters(), eval_sets={})
    refused = client.delete("/admin/datasets/faq")
    assert refused.status_code == 409, refused.text
    assert f"dataset 'faq' is used by training job {job.id}, queued or running" in refused.json()["error"]["message"]
    assert datasets.load_registry(home) == {"faq": digest}
    jobs.cancel(home, job.id)
    removed = client.delete("/admin/datasets/faq")
    assert removed.status_code == 200, removed.text
    assert removed.json() == {"name": "faq", "sha256": digest, "deleted": [digest]}
    assert datasets.load_registry(home) == {} and artifacts.keys(datasets.PREFIX) == []
    assert client.get("/admin/datasets").json() == []


def test_the_removal_is_in_the_audit_log_with_its_dataset(home: Home, artifacts: ArtifactStore,
                                                          api_client: tuple[TestClient, Caller]) -> None:
    client, _ = api_client
    datasets.register(home, {"faq": put(artifacts, "faq", "one")})
    assert client.delete("/admin/datasets/faq").status_code == 200
    [record] = [r for r in read_records(home.audit) if r.get("action") == "datasets.remove"]
    assert record["username"] == "root" and record["outcome"] == "allowed"
    assert record["target"]["kind"] == "dataset" and record["target"]["name"] == "faq"


@pytest.mark.parametrize(("method", "path", "status", "says"), [
    ("GET", "/admin/datasets/other", 404, "no dataset named 'other'"),
    ("DELETE", "/admin/datasets/other", 404, "no dataset named 'other'"),
    ("GET", "/admin/datasets/..", 404, None),  # a path of its own: no route
    ("GET", "/admin/datasets/Faq%00", 400, "dataset name 'Faq\\x00': use lower-case letters"),
    ("DELETE", "/admin/datasets/%2e%2e%5cx", 400, "dataset name '..\\\\x': use lower-case letters"),
    ("DELETE", "/admin/datasets/" + "a" * 65, 400, "use lower-case letters"),
    ("DELETE", "/admin/datasets/" + "a" * 300, 422, None),
])
def test_unknown_and_hostile_names_are_refused(home: Home, artifacts: ArtifactStore,
                                               api_client: tuple[TestClient, Caller],
                                               method: str, path: str, status: int, says: str | None) -> None:
    client, _ = api_client
    digest = put(artifacts, "faq", "one")
    datasets.register(home, {"faq": digest})
    answer = client.request(method, path)
    assert answer.status_code == status, answer.text
    if says is not None:
        assert says in answer.json()["error"]["message"]
    assert datasets.load_registry(home) == {"faq": digest} and artifacts.keys(f"{datasets.PREFIX}{digest}/")


@pytest.mark.parametrize(("method", "path"), [("GET", "/admin/datasets"), ("GET", "/admin/datasets/faq"),
                                              ("DELETE", "/admin/datasets/faq")])
def test_only_an_administrator_may_read_or_remove(home: Home, artifacts: ArtifactStore,
                                                  api_client: tuple[TestClient, Caller],
                                                  method: str, path: str) -> None:
    client, caller = api_client
    digest = put(artifacts, "faq", "one")
    datasets.register(home, {"faq": digest})
    caller.roles = frozenset({"user", "trainer", "auditor"})
    answer = client.request(method, path)
    assert answer.status_code == 403, answer.text
    assert datasets.load_registry(home) == {"faq": digest}
