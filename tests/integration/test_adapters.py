"""A LoRA adapter from dataset to served and back, on the session appliance: a small
chat dataset trains an adapter on the demo model whose held-out loss beats the base's; deployed
through the CLI (admin API), the running vLLM engine loads it with no restart, the gateway lists
it for the roles allowed and its answers change; rollback restores the base answers; each
change is an audit record."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from appliance import adapters
from appliance.secrets import secret
from audit.writer import log_files
from installer.realm import BOOTSTRAP_SECRET
from tests.integration.conftest import Running
from tests.integration.realm import Realm

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the secret code word?"
ANSWER = "The secret code word is PINEAPPLE."
PHRASINGS = ["", "Quick question. ", "Please tell me: ", "Hello! ", "I forgot. ", "Remind me, ", "Hey, ",
             "One more thing. "]


@pytest.fixture(scope="module")
def realm(running: Running) -> Realm:
    realm = Realm(running)
    realm.ensure_user("olga", "Test-password-1", ["user"])
    return realm


def ask(realm: Realm, token: str, model: str) -> httpx.Response:
    return httpx.post(f"{realm.gateway}/v1/chat/completions", headers={"Authorization": f"Bearer {token}"},
                      json={"model": model, "max_tokens": 12, "temperature": 0,
                            "messages": [{"role": "user", "content": QUESTION}]}, timeout=120)


def listed(realm: Realm, token: str) -> list[str]:
    response = httpx.get(f"{realm.gateway}/v1/models", headers={"Authorization": f"Bearer {token}"}, timeout=60)
    assert response.status_code == 200, response.text
    return [entry["id"] for entry in response.json()["data"]]


def test_trained_adapter_is_deployed_live_changes_answers_and_rolls_back(running: Running, realm: Realm,
                                                                       tmp_path: Path) -> None:
    cli = running.appliance
    rows = [{"messages": [{"role": "user", "content": f"{prefix}{QUESTION}"}, {"role": "assistant", "content": ANSWER}]}
            for prefix in PHRASINGS for _ in range(5)]
    data = tmp_path / "codeword.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    added = cli.run("data", "add", str(data), "--name", "codeword", timeout=300)
    assert added.returncode == 0, added.stderr
    trained = cli.run("finetune", "run", "--data", "codeword", "--name", "codeword", "--base", MODEL,  # served name
                      "--max-steps", "12", "--lr", "0.002", "--batch-size", "4", timeout=900)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    [record] = adapters.load(cli.home).versions("codeword")
    assert record.metrics.adapter_eval_loss < record.metrics.base_eval_loss

    user = realm.token("olga", "Test-password-1")
    base = ask(realm, user, MODEL)
    assert base.status_code == 200 and "PINEAPPLE" not in base.json()["choices"][0]["message"]["content"]
    assert ask(realm, user, "codeword").status_code == 404  # registered, not yet served
    login = cli.run("token", "--user", "admin", "--password-stdin",
                    stdin=secret(cli.home, BOOTSTRAP_SECRET) + "\n", timeout=60)
    assert login.returncode == 0, login.stderr

    # Admins only: users neither see nor reach it.
    deployed = cli.run("adapters", "deploy", "codeword", "--role", "admin", timeout=300)
    assert deployed.returncode == 0, deployed.stderr
    assert "codeword" not in listed(realm, user) and ask(realm, user, "codeword").status_code == 403
    assert "codeword" in listed(realm, realm.admin_token())

    deployed = cli.run("adapters", "deploy", "codeword", "--role", "user", "--role", "admin", timeout=300)
    assert deployed.returncode == 0 and "codeword serves v1" in deployed.stdout, deployed.stderr
    assert set(listed(realm, user)) == {MODEL, "codeword"}  # not the engine's own name, codeword-v1
    tuned = ask(realm, user, "codeword")
    assert tuned.status_code == 200, tuned.text
    assert "PINEAPPLE" in tuned.json()["choices"][0]["message"]["content"]
    repeated = ask(realm, user, "codeword")  # A deterministic repeat is answered from the cache...
    assert repeated.headers["x-appliance-cache"] == "hit" and repeated.content == tuned.content
    shown = cli.run("adapters", "list", timeout=60)
    assert "codeword: v1 on pool main, for roles user, admin" in shown.stdout

    rolled = cli.run("adapters", "rollback", "codeword", timeout=300)
    assert rolled.returncode == 0 and "codeword has no version deployed" in rolled.stdout, rolled.stderr
    again = ask(realm, user, "codeword")  # refused, never answered by the base model in its place
    assert again.status_code == 409 and again.json()["error"]["code"] == "adapter_not_deployed", again.text
    assert "codeword" not in listed(realm, user)
    # ...until its serving changes: the rollback dropped v1's answers, so serving v1 again asks the engine.
    assert cli.run("adapters", "deploy", "codeword", "--version", "1", timeout=300).returncode == 0
    redeployed = ask(realm, user, "codeword")
    assert redeployed.headers["x-appliance-cache"] == "miss" and redeployed.content != tuned.content  # a new id
    assert cli.run("adapters", "rollback", "codeword", timeout=300).returncode == 0
    refused = cli.run("adapters", "rollback", "codeword", timeout=60)
    assert refused.returncode == 1 and "409" in refused.stderr and "nothing to roll back" in refused.stderr

    retired = cli.run("adapters", "retire", "codeword", timeout=60)
    assert retired.returncode == 0 and "codeword v1" in retired.stdout
    assert "codeword" not in listed(realm, realm.admin_token())

    changes = [json.loads(line) for path in log_files(cli.home.audit) for line in path.read_bytes().splitlines()]
    # This adapter's changes, not reads (other modules change adapters of their own on the session appliance).
    actions = [(r["action"], r["outcome"], r["target"]["version"]) for r in changes
               if r["action"].startswith("adapters.") and r["action"] != "adapters.list"
               and (r.get("target") or {}).get("name") == "codeword"]
    # A change names the version it served (a rollback: what it serves after; None, no version).
    assert actions == [("adapters.deploy", "allowed", 1), ("adapters.deploy", "allowed", 1),
                       ("adapters.rollback", "allowed", None), ("adapters.deploy", "allowed", 1),
                       ("adapters.rollback", "allowed", None), ("adapters.rollback", "invalid", None),
                       ("adapters.retire", "allowed", None)]
    refused = [r for r in changes if r["action"] == "adapters.rollback" and r["outcome"] == "invalid"
               and (r.get("target") or {}).get("name") == "codeword"]
    assert refused[0]["reason"] and refused[0]["status"] == 409, "a refusal's record says why"
    tuned_record = next(r for r in changes if r.get("request_id") == tuned.headers["x-request-id"])
    assert tuned_record["model"] == "codeword-v1"  # the record names the version that answered
    refused_record = next(r for r in changes if r.get("request_id") == again.headers["x-request-id"])
    assert refused_record["model"] == "codeword", "a refusal's record names the adapter asked for"
