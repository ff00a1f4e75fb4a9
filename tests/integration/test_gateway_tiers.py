"""Serving tiers with real engines: an appliance of its own serving the demo model as
`assistant` in two tiers, `full` (two replicas) and `fast` (one, a smaller context), three vLLM
CPU engines under supervisord behind the gateway, which takes its tokens from the session
appliance's Keycloak (external mode: one Keycloak start for the whole run).

Shown: tier selection by name and by the routing policy, in headers and audit records; prefix
affinity in the gateway's replica metrics and in vLLM's own prefix-cache counters; the response
cache's hit, miss and bypass, a streamed hit, per-user isolation, and hits audited with the
original record's sequence number; a replica killed is routed around and returns by itself; a batch
of 60 requests through OpenAI's own client survives a killed worker and a `down`/`up`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import NotFoundError, OpenAI
from openai.types import Batch

from appliance import batches
from appliance.secrets import gateway_client_secret
from appliance.tls import ca_file
from audit.writer import log_files
from tests.integration.conftest import Running, engine_client
from tests.integration.realm import Realm
from tests.support.appliances import Appliance, make_appliance
from tests.support.scrape import gateway_metrics
from tests.support.tiers import TWO_TIERS

# Three engines of its own: nothing else runs beside it but the session appliance.
pytestmark = pytest.mark.alone

PASSWORD = "Test-password-1"
SYSTEM = ("You are the help desk of a bank. Answer in one short sentence, politely, and never reveal account "
          "numbers, passwords or internal procedures. ") * 6  # a long shared prefix (about 150 tokens)


@pytest.fixture(scope="module")
def realm(running: Running) -> Realm:
    realm = Realm(running)
    for name in ("tiers-ann", "tiers-bob"):
        realm.ensure_user(name, PASSWORD, ["user"])
    realm.ensure_user("tiers-admin", PASSWORD, ["admin"])
    return realm


@pytest.fixture(scope="module")
def tiers(demo_model: Path, running: Running, realm: Realm) -> Iterator[Appliance]:
    session = running.appliance
    keycloak = {"APPLIANCE_KEYCLOAK__MODE": "external", "APPLIANCE_KEYCLOAK__URL": realm.settings.keycloak.base_url,
                "APPLIANCE_KEYCLOAK__CA_FILE": str(ca_file(session.home)),
                "APPLIANCE_KEYCLOAK__GATEWAY_CLIENT_SECRET": gateway_client_secret(realm.settings, session.home),
                "APPLIANCE_GATEWAY__INTROSPECT_TTL_S": "30"}
    for appliance in make_appliance(demo_model, None, **keycloak):
        appliance.home.settings_file.write_text(TWO_TIERS)
        started = appliance.run("up", timeout=1200)
        assert started.returncode == 0, started.stdout + started.stderr
        yield appliance


def url(appliance: Appliance) -> str:
    return f"http://127.0.0.1:{appliance.port('APPLIANCE_GATEWAY__PORT')}"


def chat(appliance: Appliance, realm: Realm, user: str, model: str, content: str, *, stream: bool = False,
         headers: dict[str, str] | None = None, system: str = SYSTEM, **fields: object) -> httpx.Response:
    token = realm.token(user, PASSWORD)
    body = {"model": model, "max_tokens": 6, "temperature": 0, "stream": stream,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": content}], **fields}
    return httpx.post(f"{url(appliance)}/v1/chat/completions", json=body, timeout=300,
                      headers={"Authorization": f"Bearer {token}", **(headers or {})})


def every_record(appliance: Appliance) -> list[dict]:
    return [json.loads(line) for path in log_files(appliance.home.audit) for line in path.read_bytes().splitlines()]


def records(appliance: Appliance) -> dict[str, dict]:
    """The audit records of requests, by request id."""
    return {record["request_id"]: record for record in every_record(appliance) if record["request_id"]}


def choices(appliance: Appliance) -> dict[tuple[str, str], float]:
    """gateway_route_choices_total by (replica, reason)."""
    text = gateway_metrics(url(appliance), appliance.home)
    counted: dict[tuple[str, str], float] = {}
    for found in re.finditer(r'gateway_route_choices_total\{pool="full",reason="(\w+)",replica="(\w+)"\} (\S+)',
                             text):
        counted[(found[2], found[1])] = float(found[3])
    return counted


def prefix_hits(appliance: Appliance, replica: str) -> float:
    """vLLM's own count of prompt tokens found in its prefix cache, on one replica."""
    with engine_client(appliance, replica, timeout=30) as engine:
        text = engine.get("/metrics").text
    return sum(float(found[1]) for found in re.finditer(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)", text, re.M))


def test_a_tier_is_chosen_by_name_or_by_the_policy(tiers: Appliance, realm: Realm) -> None:
    fast = chat(tiers, realm, "tiers-ann", "assistant:fast", "Hello", temperature=0.7)
    full = chat(tiers, realm, "tiers-ann", "assistant:full", "Hello", temperature=0.7)
    streamed = chat(tiers, realm, "tiers-ann", "assistant", "Hello", stream=True, temperature=0.7)
    whole = chat(tiers, realm, "tiers-ann", "assistant", "Hello", temperature=0.7)
    assert [r.status_code for r in (fast, full, streamed, whole)] == [200] * 4, fast.text + full.text
    assert [r.headers["x-appliance-tier"] for r in (fast, full, streamed, whole)] == ["fast", "full", "fast", "full"]
    assert fast.json()["model"] == "assistant"  # the engine's name, the tier is the gateway's
    assert "data: [DONE]" in streamed.text
    audit = records(tiers)
    assert [audit[r.headers["x-request-id"]]["tier"] for r in (fast, full, streamed, whole)] == \
        ["fast", "full", "fast", "full"]
    assert audit[full.headers["x-request-id"]]["replica"] in {"full", "full_1"}
    missing = chat(tiers, realm, "tiers-ann", "assistant:huge", "Hello")
    assert missing.status_code == 404 and "assistant:fast, assistant:full" in missing.json()["error"]["message"]
    assert chat(tiers, realm, "tiers-ann", "nothing:fast", "Hello").status_code == 404


def test_prefix_affinity_keeps_a_shared_prefix_on_one_replica(tiers: Appliance, realm: Realm) -> None:
    before = choices(tiers)
    hits_before = {replica: prefix_hits(tiers, replica) for replica in ("full", "full_1")}
    served = []
    for question in ("Where is my card?", "How do I reset my PIN?", "What are your opening hours?",
                     "Can I raise my limit?", "Is there a fee for transfers?"):
        answer = chat(tiers, realm, "tiers-bob", "assistant:full", question, temperature=0.5)
        assert answer.status_code == 200, answer.text
        served.append(records(tiers)[answer.headers["x-request-id"]]["replica"])
    assert len(set(served)) == 1, served  # one after another: the replica holding the prefix each time
    after = choices(tiers)
    assert after.get((served[0], "affinity"), 0) - before.get((served[0], "affinity"), 0) >= 4
    gained = prefix_hits(tiers, served[0]) - hits_before[served[0]]
    assert gained >= 4 * 100, f"vLLM found only {gained} prompt tokens in its prefix cache"
    pools = httpx.get(f"{url(tiers)}/admin/pools", timeout=60,
                      headers={"Authorization": f"Bearer {realm.token('tiers-admin', PASSWORD)}"}).json()
    full = next(pool for pool in pools if pool["name"] == "full")
    assert [(r["name"], r["taking_requests"], r["in_flight"]) for r in full["replicas"]] == \
        [("full", True, 0), ("full_1", True, 0)]
    admin = {"Authorization": f"Bearer {realm.token('tiers-admin', PASSWORD)}"}
    for balance in ("round_robin", "nonsense", "affinity"):
        changed = httpx.put(f"{url(tiers)}/admin/routing/balance", json={"balance": balance}, headers=admin,
                            timeout=30)
        assert changed.status_code == (422 if balance == "nonsense" else 200), changed.text
    user = {"Authorization": f"Bearer {realm.token('tiers-bob', PASSWORD)}"}
    assert httpx.put(f"{url(tiers)}/admin/routing/balance", json={"balance": "round_robin"}, headers=user,
                     timeout=30).status_code == 403
    assert httpx.get(f"{url(tiers)}/admin/routing", headers=admin, timeout=30).json()["policy"]["balance"] == \
        "affinity"


def test_the_cache_answers_repeats_per_user_streams_hits_and_audits_them(tiers: Appliance, realm: Realm) -> None:
    question = "Cache test: what is two plus two?"
    first = chat(tiers, realm, "tiers-ann", "assistant:full", question)
    second = chat(tiers, realm, "tiers-ann", "assistant:full", question)
    other_user = chat(tiers, realm, "tiers-bob", "assistant:full", question)
    bypass = chat(tiers, realm, "tiers-ann", "assistant:full", question, headers={"Cache-Control": "no-cache"})
    sampled = chat(tiers, realm, "tiers-ann", "assistant:full", question, temperature=0.9)  # not deterministic
    assert [r.headers.get("x-appliance-cache") for r in (first, second, other_user, bypass, sampled)] == \
        ["miss", "hit", "miss", "bypass", None]
    assert second.content == first.content and other_user.json()["id"] != first.json()["id"]
    audit = records(tiers)
    original = audit[first.headers["x-request-id"]]
    hit = audit[second.headers["x-request-id"]]
    assert hit["cache_hit_of"] == original["seq"] and hit["completion_hmac"] == original["completion_hmac"]
    assert hit["replica"] is None and hit["completion_tokens"] == 0 and original["completion_tokens"] > 0
    assert audit[bypass.headers["x-request-id"]]["cache_hit_of"] is None

    streamed = chat(tiers, realm, "tiers-ann", "assistant:fast", question, stream=True)
    replayed = chat(tiers, realm, "tiers-ann", "assistant:fast", question, stream=True)
    assert [r.headers["x-appliance-cache"] for r in (streamed, replayed)] == ["miss", "hit"]
    assert replayed.headers["content-type"].startswith("text/event-stream") and replayed.text == streamed.text
    audit = records(tiers)
    assert audit[replayed.headers["x-request-id"]]["cache_hit_of"] == audit[streamed.headers["x-request-id"]]["seq"]

    admin = {"Authorization": f"Bearer {realm.token('tiers-admin', PASSWORD)}"}
    stats = httpx.get(f"{url(tiers)}/admin/cache", headers=admin, timeout=30).json()
    assert stats["hits"] >= 2 and stats["entries"] >= 3 and 0 < stats["hit_rate"] < 1
    flushed = httpx.post(f"{url(tiers)}/admin/cache/flush", headers=admin, timeout=30)
    assert flushed.status_code == 200 and flushed.json()["flushed"] == stats["entries"]
    assert chat(tiers, realm, "tiers-ann", "assistant:full", question).headers["x-appliance-cache"] == "miss"

    login = tiers.run("token", "--user", "tiers-admin", "--password-stdin", stdin=PASSWORD + "\n", timeout=60)
    assert login.returncode == 0, login.stderr
    shown = tiers.run("serving", "cache", timeout=60)
    assert shown.returncode == 0 and "1/4096 entries" in shown.stdout and "hit rate" in shown.stdout, shown.stderr
    listed = tiers.run("serving", "pools", timeout=60)
    assert listed.returncode == 0, listed.stderr
    for tier, replica in (("full", "full"), ("full", "full_1"), ("fast", "fast")):
        assert re.search(rf"assistant\W+{tier}\W+{replica}\W+healthy", listed.stdout), listed.stdout
    flushed = tiers.run("serving", "flush-cache", timeout=60)
    assert flushed.returncode == 0 and "1 entries dropped" in flushed.stdout


def test_a_killed_replica_is_routed_around_and_returns(tiers: Appliance, realm: Realm) -> None:
    def full_1() -> dict:
        admin = {"Authorization": f"Bearer {realm.token('tiers-admin', PASSWORD)}"}
        pools = httpx.get(f"{url(tiers)}/admin/pools", headers=admin, timeout=60).json()
        return next(r for pool in pools for r in pool["replicas"] if r["name"] == "full_1")

    def ask(index: int) -> str:
        """The replica that answered a prompt sharing no prefix with the others (least loaded, in turn)."""
        answer = chat(tiers, realm, "tiers-bob", "assistant:full", "Which replica?", temperature=0.5,
                      system=f"Request {index} of round {uuid.uuid4().hex[:6]}: answer briefly.")
        assert answer.status_code == 200, answer.text
        return str(records(tiers)[answer.headers["x-request-id"]]["replica"])

    status = json.loads(tiers.run("status", "--json", timeout=60).stdout)
    victim = next(p for p in status["programs"] if p["name"] == "vllm-full_1")
    os.killpg(victim["pid"], signal.SIGKILL)  # the engine and its workers (supervisord gives each a group)
    served = [ask(index) for index in range(6)]  # every request answered, by the live replica
    assert set(served) == {"full"}, served
    deadline, set_aside = time.monotonic() + 600, False
    while True:  # set aside (by a request that found it gone, or the health watch), restarted, taken back
        replica = full_1()
        set_aside = set_aside or not replica["taking_requests"]
        if set_aside and replica["taking_requests"] and replica["healthy"]:
            break
        assert time.monotonic() < deadline, f"the killed replica never returned: {replica}"
        time.sleep(1)
    assert "engine full_1 set aside" in (tiers.home.root / "logs" / "gateway.log").read_text()
    returned = [ask(index) for index in range(4)]
    assert "full_1" in returned, returned
    assert ready_gauge(tiers) == 1.0


def ready_gauge(appliance: Appliance) -> float:
    text = gateway_metrics(url(appliance), appliance.home)
    return float(re.search(r'gateway_replica_ready\{pool="full",replica="full_1"\} (\S+)', text)[1])


def test_a_batch_runs_through_a_worker_kill_and_a_down_up_with_the_openai_client(tiers: Appliance, realm: Realm,
                                                                                  tmp_path: Path) -> None:
    """OpenAI's Batch API with its official client: 60 requests, the worker killed mid-batch and the
    whole appliance taken down and up again mid-batch; the output file has one answer per custom_id."""
    client = OpenAI(base_url=f"{url(tiers)}/v1", api_key=realm.token("tiers-ann", PASSWORD), max_retries=0)
    lines = [json.dumps({"custom_id": f"q-{index:03d}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "assistant", "max_tokens": 24,
                                  "messages": [{"role": "user", "content": f"Count to {index % 7 + 3}."}]}})
             for index in range(60)]
    source = tmp_path / "batch.jsonl"
    source.write_text("\n".join(lines) + "\n")
    uploaded = client.files.create(file=source.open("rb"), purpose="batch")
    assert uploaded.bytes == source.stat().st_size and uploaded.filename == "batch.jsonl"
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"purpose": "test"})
    assert batch.status == "validating"  # at once: the batch-worker reads the file
    batch = settled(client, batch.id)
    assert batch.status == "in_progress" and batch.request_counts.total == 60, batch

    def completed_at_least(count: int, limit_s: float = 900) -> int:
        deadline = time.monotonic() + limit_s
        while True:
            done = batches.get(tiers.home, batch.id, None).request_counts.completed
            if done >= count:
                return done
            assert time.monotonic() < deadline, f"{done} of {count} requests done"
            time.sleep(0.5)

    completed_at_least(3)
    status = json.loads(tiers.run("status", "--json", timeout=60).stdout)
    worker = next(p for p in status["programs"] if p["name"] == "batch-worker")
    os.kill(worker["pid"], signal.SIGKILL)
    done = completed_at_least(completed_at_least(3) + 6)  # a new worker takes the dead one's claims over
    down = tiers.run("down", timeout=300)
    assert down.returncode == 0, down.stderr
    stopped = batches.get(tiers.home, batch.id, None)
    assert stopped.status == "in_progress" and done <= stopped.request_counts.completed < 60, stopped
    up = tiers.run("up", timeout=1200)
    assert up.returncode == 0, up.stdout + up.stderr

    client = OpenAI(base_url=f"{url(tiers)}/v1", api_key=realm.token("tiers-ann", PASSWORD), max_retries=0)
    deadline = time.monotonic() + 900
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(2)
    errors = client.files.content(batch.error_file_id).text if batch.error_file_id else ""
    assert batch.status == "completed" and batch.request_counts.completed == 60, (batch, errors[:3000])
    assert batch.request_counts.failed == 0
    assert batch.output_file_id and batch.error_file_id is None and batch.completed_at
    output = [json.loads(row) for row in client.files.content(batch.output_file_id).text.splitlines()]
    assert [row["custom_id"] for row in output] == [f"q-{index:03d}" for index in range(60)]
    assert all(row["response"]["status_code"] == 200 and row["response"]["body"]["choices"] for row in output)
    assert batch.id in [listed.id for listed in client.batches.list()]
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(NotFoundError):
        client.files.retrieve(uploaded.id)

    audit = records(tiers)
    executed = {record["batch"].split(":")[1] for record in audit.values() if (record.get("batch") or "")
                .startswith(batch.id + ":") and record["action"] == "chat.completions" and record["status"] == 200}
    assert len(executed) == 60  # each request's own record (a request the killed worker ran may have two)
    ran = [record for record in audit.values() if record.get("batch", "") and record["batch"].startswith(batch.id)]
    assert {record["tier"] for record in ran} == {"full"} and {record["username"] for record in ran} == {"tiers-ann"}
    # Records of changes share no request id. The worker records a batch's end just after the batch
    # shows it (once, after a crash too), so that record may come a moment after the status.
    def of_this_batch(action: str) -> list[dict]:
        return [record for record in every_record(tiers)
                if record["action"] == action and (record.get("target") or {}).get("name") == batch.id]

    deadline = time.monotonic() + 120
    while not of_this_batch("batches.completed"):
        assert time.monotonic() < deadline, "no record of the batch's end"
        time.sleep(0.5)
    assert of_this_batch("batches.create")

    other = OpenAI(base_url=f"{url(tiers)}/v1", api_key=realm.token("tiers-bob", PASSWORD), max_retries=0)
    with pytest.raises(NotFoundError):
        other.batches.retrieve(batch.id)  # another user's batch is as one that does not exist
    with pytest.raises(NotFoundError):
        other.files.content(batch.output_file_id)
    # Only the batch-worker's key makes a request run as a batch's owner: a user's token does not.
    body = {"model": "assistant", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    for key in (realm.token("tiers-bob", PASSWORD), "guess"):
        posed = httpx.post(f"{url(tiers)}/v1/chat/completions", json=body, timeout=60,
                           headers={"Authorization": f"Bearer {key}", "X-Appliance-Batch-Request": f"{batch.id}:1"})
        assert posed.status_code == 401 and "ann" not in posed.text
    bad = other.files.create(file=("bad.jsonl", b'{"custom_id": "x"}\nnot json\n'), purpose="batch")
    refused = other.batches.create(input_file_id=bad.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert refused.status == "validating"
    refused = settled(other, refused.id)
    assert refused.status == "failed" and refused.errors is not None and refused.failed_at
    assert [(error.line, error.param) for error in refused.errors.data or []] == [(1, "method"), (2, None)]
    deadline = time.monotonic() + 60
    while f"batch {refused.id} failed validation" not in json.dumps(every_record(tiers)):  # the worker's record
        assert time.monotonic() < deadline, "no audit record of the failed validation"
        time.sleep(1)


def settled(client: OpenAI, batch_id: str, limit_s: float = 120) -> Batch:
    """A batch once the batch-worker has validated it (OpenAI's client polling, as a user does)."""
    deadline = time.monotonic() + limit_s
    while (batch := client.batches.retrieve(batch_id)).status == "validating":
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)
    return batch
