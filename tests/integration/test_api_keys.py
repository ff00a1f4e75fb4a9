"""API keys through the official OpenAI client against the real gateway, Keycloak and vLLM: chat,
stream and batch; revoked mid-use; its owner disabled; expiry; a model limit; the audit records
naming the key; keys kept out of /admin; the gateway's added latency with a key against a token."""

from __future__ import annotations

import json
import statistics
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from appliance import api_keys, batches
from audit.writer import log_files
from tests.integration.conftest import Running
from tests.integration.realm import Realm

MODEL = "SmolLM2-135M-Instruct"
RUN = uuid.uuid4().hex[:6]  # key names are never reused: each run makes its own
K = {name: f"{name}-{RUN}" for name in ("kara-app", "kurt-app", "kurt-old", "kim-scoped", "kim-app", "kbench-app",
                                        "kim-for-kara", "kim-x", "kurt-tight", "kurt-batch", "shared", "kyle-batch")}
PASSWORD = "Test-password-1"
INTROSPECT_TTL_S = 10  # the gateway's default: a disabled owner's keys stop within it
REFUSAL_INTERVAL_S = 10  # audit.refusal_interval_s's default
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def realm(running: Running) -> Realm:
    realm = Realm(running)
    for user in ("kara", "kurt", "kim", "kyle"):
        realm.admin.update_user(realm.ensure_user(user, PASSWORD, ["user"]), {"enabled": True})  # kim: disabled before
    return realm


def admin(realm: Realm, method: str, path: str, token: str | None = None, **kwargs: Any) -> httpx.Response:
    return httpx.request(method, f"{realm.gateway}/admin{path}", timeout=60,
                         headers={"Authorization": f"Bearer {token or realm.admin_token()}"}, **kwargs)


def new_key(realm: Realm, name: str, owner: str, **fields: Any) -> str:
    made = admin(realm, "POST", "/keys", json={"name": name, "owner": owner, **fields})
    assert made.status_code == 201, made.text
    return str(made.json()["secret"])


def client(realm: Realm, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{realm.gateway}/v1", api_key=key, max_retries=0, timeout=120)


def records(running: Running) -> list[dict[str, Any]]:
    return [json.loads(line) for path in log_files(running.appliance.home.audit)
            for line in path.read_bytes().splitlines()]


def refused(call: Any) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    return caught.value


def test_a_key_chats_streams_and_batches_and_every_record_names_it(realm: Realm, running: Running,
                                                                     tmp_path: Path) -> None:
    key = new_key(realm, K["kara-app"], "kara")
    assert key.startswith("apk-") and len(key) == 47
    stored = (running.appliance.home.root / "api-keys.json").read_text()
    assert key not in stored and key[4:] not in stored  # only a keyed hash is kept
    api = client(realm, key)
    # The base model, and any adapter another module of the session has registered meanwhile.
    assert MODEL in [m.id for m in api.models.list()]
    answer = api.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0)
    assert answer.choices[0].message.content
    pieces = [c.choices[0].delta.content for c in api.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=8, temperature=0, stream=True) if c.choices]
    assert "".join(p for p in pieces if p)
    lines = [json.dumps({"custom_id": f"k-{n}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": MODEL, "max_tokens": 4, "messages": QUESTION}}) for n in range(2)]
    source = tmp_path / "batch.jsonl"
    source.write_text("\n".join(lines) + "\n")
    uploaded = api.files.create(file=source.open("rb"), purpose="batch")
    batch = api.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 300
    while (batch := api.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)
    assert batch.status == "completed" and batch.request_counts.completed == 2, batch

    mine = [r for r in records(running) if r.get("key") == K["kara-app"]]
    actions = {r["action"] for r in mine}
    assert {"models.list", "chat.completions", "files.create", "batches.create"} <= actions, actions
    assert all(r["client"] in (f"key:{K['kara-app']}", "batch-worker") and r["username"] == "kara" for r in mine)
    [created] = [r for r in mine if r["action"] == "batches.create"]
    assert created["target"] == {"kind": "batch", "name": batch.id, "version": None, "roles": None}
    deadline = time.monotonic() + 60  # the worker records a batch's end after it has ended
    while not (ended := [r for r in records(running) if r["action"] == "batches.completed"
                         and (r.get("target") or {}).get("name") == batch.id]):
        assert time.monotonic() < deadline, "no record of the batch's end"
        time.sleep(0.5)
    assert ended[0]["username"] == ended[0]["client"] == "batch-worker"
    lines = [r for r in records(running) if (r.get("batch") or "").startswith(f"{batch.id}:")]
    assert len(lines) == 2 and all(r["key"] == K["kara-app"] and r["client"] == "batch-worker" for r in lines), \
        "a batch's requests name the key it was made with"
    made = [r for r in records(running) if r["action"] == "keys.create"
            and (r.get("target") or {}).get("name") == K["kara-app"]]
    assert made and made[0]["outcome"] == "allowed" and made[0]["resource"] == "/admin/keys"
    assert key not in json.dumps(records(running))


def test_revoked_expired_disabled_and_scoped_keys_are_refused(realm: Realm, running: Running) -> None:
    key = new_key(realm, K["kurt-app"], "kurt")
    api = client(realm, key)
    api.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
    listed = admin(realm, "GET", "/keys", realm.token("kurt", PASSWORD)).json()
    [listed] = [k for k in listed if k["name"] == K["kurt-app"]]
    assert listed["state"] == "active" and listed["owner"] == "kurt"
    assert "digest" not in listed and listed["last_used"] is not None
    # Revoked mid-use: the next call is refused.
    assert admin(realm, "POST", f"/keys/{K['kurt-app']}/revoke", realm.token("kurt", PASSWORD)).status_code == 200
    error = refused(lambda: api.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2))
    assert error.status_code == 401 and error.body["code"] == "revoked_key"

    # Expired: a key whose expiry has passed (the registry written as time would have it).
    stale = new_key(realm, K["kurt-old"], "kurt", expires_in="1h")
    with api_keys.registry(running.appliance.home).change() as keys:
        past = datetime.now(UTC) - timedelta(seconds=1)
        index = api_keys.ref("kurt", K["kurt-old"])
        keys[index] = keys[index].model_copy(update={"expires": past})
    error = refused(lambda: client(realm, stale).models.list())
    assert error.status_code == 401 and error.body["code"] == "expired_key"

    # Its own token budget, on top of its owner's.
    tight = client(realm, new_key(realm, K["kurt-tight"], "kurt", tokens_per_minute=60))
    tight.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)
    error = refused(lambda: tight.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=100))
    assert error.status_code == 400 and error.body["code"] == "exceeds_token_budget"
    assert f"API key kurt/{K['kurt-tight']}" in error.body["message"]  # a key is its owner's and its name

    # A model limit: other models are refused, the listing shows only its own.
    scoped = client(realm, new_key(realm, K["kim-scoped"], "kim", models=["some-other-model"]))
    error = refused(lambda: scoped.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2))
    assert error.status_code == 403 and error.body["code"] == "model_not_allowed"
    assert scoped.models.list().data == []

    # Keys never reach /admin, not even to make keys.
    keyed = admin(realm, "GET", "/keys", key)
    assert keyed.status_code in (401, 403)
    other = new_key(realm, K["kim-app"], "kim")
    assert admin(realm, "GET", "/keys", other).json()["error"]["code"] == "key_not_allowed"
    # A user manages their own keys only.
    assert admin(realm, "POST", "/keys", realm.token("kim", PASSWORD),
                 json={"name": K["kim-for-kara"], "owner": "kara"}).status_code == 403
    # A bad name or duration names the field.
    bad = admin(realm, "POST", "/keys", json={"name": "../x", "owner": "kim"})
    assert bad.status_code in (400, 422) and "name" in bad.text
    bad = admin(realm, "POST", "/keys", json={"name": K["kim-x"], "owner": "kim", "expires_in": "tomorrow"})
    assert bad.status_code == 400 and "expires_in" in bad.text

    # Its owner disabled: their keys stop within the introspection interval.
    working = client(realm, other)
    working.models.list()
    assert admin(realm, "POST", "/users/kim/disable").status_code == 200
    deadline = time.monotonic() + INTROSPECT_TTL_S + 30
    while True:
        try:
            working.models.list()
        except openai.AuthenticationError as exc:
            assert exc.body["code"] == "inactive"
            break
        assert time.monotonic() < deadline, "a disabled user's key kept working"
        time.sleep(0.5)
    # Its refusal names the key and its owner: in a record of its own, or (refusals from one source
    # are summarised per interval) in the summary the interval ends with.
    deadline = time.monotonic() + REFUSAL_INTERVAL_S + 30
    while not [r for r in records(running) if r.get("key") == K["kim-app"] and r["reason"] == "inactive"
               and r["username"] == "kim" and r["outcome"] == "denied"]:
        assert time.monotonic() < deadline, "no record of the disabled owner's key refused"
        time.sleep(0.5)


def test_the_gateway_adds_no_more_with_a_key_than_with_a_token(realm: Realm, running: Running,
                                                                 record_property: pytest.RecordProperty) -> None:
    """/v1/models answered by the gateway alone (its engine listing): a key against a cached token,
    taking turns, 200 rounds each; the ratio of their medians is the figure."""
    realm.ensure_user("kbench", PASSWORD, ["admin"])  # an administrator's rate limit: 400 calls pass
    key = new_key(realm, K["kbench-app"], "kbench")
    token = realm.token("kbench", PASSWORD)
    timings: dict[str, list[float]] = {"key": [], "token": []}
    with httpx.Client(base_url=realm.gateway, timeout=60) as http:
        for _ in range(200):
            for name, credential in (("token", token), ("key", key)):
                started = time.perf_counter()
                assert http.get("/v1/models", headers={"Authorization": f"Bearer {credential}"}).status_code == 200
                timings[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(times) * 1000 for name, times in timings.items()}
    record_property("p50_ms", medians)
    print(f"gateway /v1/models p50: key {medians['key']:.2f} ms, token {medians['token']:.2f} ms, "
          f"ratio {medians['key'] / medians['token']:.3f}")


def test_a_keys_limits_hold_for_its_batches_and_revoking_it_stops_them(realm: Realm, tmp_path: Path) -> None:
    """A batch made with a key runs within the key's budget, and stops when the key is revoked:
    its requests are refused (403) and the batch ends with them failed."""
    def batch_of(api: openai.OpenAI, lines: int, max_tokens: int) -> str:
        source = tmp_path / f"b{lines}-{max_tokens}.jsonl"
        source.write_text("".join(json.dumps({"custom_id": f"r{n}", "method": "POST", "url": "/v1/chat/completions",
                                              "body": {"model": MODEL, "max_tokens": max_tokens,
                                                       "messages": QUESTION}}) + "\n" for n in range(lines)))
        uploaded = api.files.create(file=source.open("rb"), purpose="batch")
        return api.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h").id

    def ended(api: openai.OpenAI, batch_id: str) -> Any:
        deadline = time.monotonic() + 300
        while (batch := api.batches.retrieve(batch_id)).status not in ("completed", "failed", "cancelled"):
            assert time.monotonic() < deadline, batch
            time.sleep(0.5)
        return batch

    def errors(api: openai.OpenAI, batch: Any) -> list[dict[str, Any]]:
        return [json.loads(line)["response"]["body"]["error"]
                for line in api.files.content(batch.error_file_id).text.splitlines()]

    tight = client(realm, new_key(realm, K["kurt-tight"] + "-b", "kurt", tokens_per_minute=60))
    over = ended(tight, batch_of(tight, 2, 100))
    assert over.request_counts.failed == 2, over
    assert {error["code"] for error in errors(tight, over)} == {"exceeds_token_budget"}

    key = new_key(realm, K["kurt-batch"], "kurt")
    api = client(realm, key)
    made = batch_of(api, 3, 4)
    assert admin(realm, "POST", f"/keys/{K['kurt-batch']}/revoke").status_code == 200
    stopped = ended(client(realm, realm.token("kurt", PASSWORD)), made)  # the key no longer reads it
    assert stopped.request_counts.failed == 3, stopped
    assert {error["code"] for error in errors(client(realm, realm.token("kurt", PASSWORD)), stopped)} == {
        "revoked_key"}
    # Revoked, it can be removed (administrators), and its name used again.
    assert admin(realm, "DELETE", f"/keys/{K['kurt-batch']}").status_code == 200
    new_key(realm, K["kurt-batch"], "kurt")


def test_key_names_are_each_users_own_and_tell_nothing_of_anothers(realm: Realm) -> None:
    """Two users each make a key of one name (no 409 tells either of the other's); every
    operation goes by user and name."""
    name = K["shared"]
    kara, kurt = realm.token("kara", PASSWORD), realm.token("kurt", PASSWORD)
    karas = admin(realm, "POST", "/keys", kara, json={"name": name, "owner": "kara"})
    kurts = admin(realm, "POST", "/keys", kurt, json={"name": name, "owner": "kurt"})
    assert karas.status_code == kurts.status_code == 201, (karas.text, kurts.text)
    again = admin(realm, "POST", "/keys", kurt, json={"name": name, "owner": "kurt"})
    assert again.status_code == 409 and f"kurt already has an API key named {name!r}" in again.text, again.text
    assert {k["owner"] for k in admin(realm, "GET", "/keys", kurt).json() if k["name"] == name} == {"kurt"}
    # Kurt revokes his: Kara's key of the same name keeps working.
    assert admin(realm, "POST", f"/keys/{name}/revoke", kurt).json()["owner"] == "kurt"
    error = refused(lambda: client(realm, kurts.json()["secret"]).models.list())
    assert error.status_code == 401 and error.body["code"] == "revoked_key"
    assert MODEL in [m.id for m in client(realm, karas.json()["secret"]).models.list()]
    # Naming another user's key is refused whether it exists or not; an administrator says whose.
    for other in (name, "no-such-key"):
        assert admin(realm, "POST", f"/keys/{other}/revoke", kurt, params={"owner": "kara"}).status_code == 403
    both = admin(realm, "POST", f"/keys/{name}/revoke")
    assert both.status_code == 400 and "2 users have an API key named" in both.text, both.text
    assert admin(realm, "DELETE", f"/keys/{name}", params={"owner": "kurt"}).json()["owner"] == "kurt"
    assert admin(realm, "POST", f"/keys/{name}/revoke", params={"owner": "kara"}).json()["state"] == "revoked"


def test_a_keys_batch_stops_when_its_owner_loses_the_user_role(realm: Realm, running: Running,
                                                                tmp_path: Path) -> None:
    """A batch made with a key: its owner loses the `user` role while it waits, and its requests
    fail (403 missing_role) instead of running as a user's."""
    api = client(realm, new_key(realm, K["kyle-batch"], "kyle"))
    source = tmp_path / "kyle.jsonl"
    source.write_text("".join(json.dumps({"custom_id": f"r{n}", "method": "POST", "url": "/v1/chat/completions",
                                          "body": {"model": MODEL, "max_tokens": 2, "messages": QUESTION}}) + "\n"
                              for n in range(20)))
    uploaded = api.files.create(file=source.open("rb"), purpose="batch")
    made = api.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert admin(realm, "DELETE", "/users/kyle/roles/user").status_code == 200
    try:
        deadline = time.monotonic() + 300
        while (batch := batches.get(running.appliance.home, made.id, None)).status not in ("completed", "failed",
                                                                                           "cancelled"):
            assert time.monotonic() < deadline, batch
            time.sleep(0.5)
    finally:
        assert admin(realm, "POST", "/users/kyle/roles", json={"role": "user"}).status_code == 200
    assert batch.request_counts.total == 20 and batch.request_counts.failed >= 1, batch
    deadline = time.monotonic() + 60  # the role back counts within the introspection interval
    while True:
        try:
            failures = api.files.content(str(batch.error_file_id)).text.splitlines()
            break
        except openai.PermissionDeniedError:
            assert time.monotonic() < deadline, "the role given back did not count"
            time.sleep(0.5)
    assert {json.loads(line)["response"]["body"]["error"]["code"] for line in failures} == {"missing_role"}
