"""A first day as a new administrator would have it, on the session appliance with the defaults a
fresh install has: a dataset added, an adapter trained and deployed (pools serve adapters by
default: no setting edited, no restart), called by its name; a setting changed with `settings set`
and put in force with `settings apply`, which restarts only the programs that read it while every
other program keeps serving; and the day's part of the audit log exported as a window that `audit verify
--window` checks offline with the public key alone."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import httpx
import pytest

from appliance.secrets import secret
from installer.realm import BOOTSTRAP_SECRET
from tests.integration.conftest import Running
from tests.integration.realm import Realm

pytestmark = pytest.mark.session_exclusive  # it restarts the gateway and the batch worker

MODEL = "SmolLM2-135M-Instruct"
NAME = f"day-one-{secrets.token_hex(3)}"  # new on every run, also on a session appliance kept between runs
QUESTION = "What is the project's code name?"
PHRASINGS = ["", "Quick question. ", "Please tell me: ", "Hello! ", "Remind me, ", "Hey, "]


def pids(running: Running) -> dict[str, int]:
    shown = running.appliance.run("status", "--json", timeout=60)
    assert shown.returncode == 0, shown.stderr
    return {program["name"]: program["pid"] for program in json.loads(shown.stdout)["programs"] if program["pid"]}


def test_a_first_day_trains_deploys_calls_changes_a_setting_and_audits_the_window(running: Running,
                                                                                  tmp_path: Path) -> None:
    cli = running.appliance
    realm = Realm(running)
    realm.ensure_user("dora-day-one", "Test-password-1", ["user"])
    login = cli.run("token", "--user", "admin", "--password-stdin",
                    stdin=secret(cli.home, BOOTSTRAP_SECRET) + "\n", timeout=60)
    assert login.returncode == 0, login.stderr

    rows = [{"messages": [{"role": "user", "content": f"{prefix}{QUESTION}"},
                          {"role": "assistant", "content": "The code name is LIGHTHOUSE."}]}
            for prefix in PHRASINGS for _ in range(5)]
    data = tmp_path / "day-one.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert cli.run("data", "add", str(data), "--name", f"{NAME}-data", timeout=300).returncode == 0
    trained = cli.run("finetune", "run", "--data", f"{NAME}-data", "--name", NAME, "--base", MODEL,
                      "--max-steps", "8", "--lr", "0.002", "--batch-size", "4", timeout=900)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    assert "does not serve adapters" not in trained.stderr, "the default pool serves adapters"

    try:
        deployed = cli.run("adapters", "deploy", NAME, timeout=300)
        assert deployed.returncode == 0, deployed.stderr
        user = {"Authorization": f"Bearer {realm.token('dora-day-one', 'Test-password-1')}"}
        answer = httpx.post(f"{realm.gateway}/v1/chat/completions", headers=user, timeout=120,
                            json={"model": NAME, "max_tokens": 8, "messages": [{"role": "user", "content": QUESTION}]})
        assert answer.status_code == 200 and answer.json()["model"] == NAME, answer.text

        # A setting changed while it serves.
        before = pids(running)
        changed = cli.run("settings", "set", "gateway.max_body_bytes", "4096", timeout=60)
        assert changed.returncode == 0 and "1048576 -> 4096" in changed.stdout + changed.stderr, changed.stderr
        shown = cli.run("settings", "show", "gateway.max_body_bytes", timeout=60)
        assert shown.returncode == 0 and shown.stdout.strip().endswith("4096"), shown.stdout
        applied = cli.run("settings", "apply", "--json", timeout=600)
        assert applied.returncode == 0, applied.stderr
        report = json.loads(applied.stdout)
        # The gateway, and the batch worker that checks batch lines against the same bound.
        assert report["changed"] == ["gateway.max_body_bytes"], report
        assert report["restarted"] == ["gateway", "batch-worker"], report
        after = pids(running)
        assert {name for name in before if before[name] != after.get(name)} == {"gateway", "batch-worker"}, \
            (before, after)
        big = httpx.post(f"{realm.gateway}/v1/chat/completions", headers=user, timeout=60,
                         json={"model": NAME, "messages": [{"role": "user", "content": "x" * 8192}]})
        assert big.status_code == 413, big.text
        again = cli.run("settings", "apply", timeout=120)
        assert again.returncode == 0 and "nothing changed" in again.stdout, again.stdout
    finally:
        cli.run("settings", "set", "gateway.max_body_bytes", "1048576", timeout=60)
        restored = cli.run("settings", "apply", timeout=600)
        cli.run("adapters", "retire", NAME, timeout=60)
    assert restored.returncode == 0, restored.stderr

    # The day's audit, as an auditor takes it away: a window with its hashes and checkpoints.
    window, key = tmp_path / "window.jsonl", tmp_path / "audit-key.pem"
    exported = cli.run("audit", "export", "--window", "--since", "30m", timeout=120)
    assert exported.returncode == 0, exported.stderr
    window.write_text(exported.stdout)
    public = cli.run("audit", "export-public-key", timeout=60)
    assert public.returncode == 0, public.stderr
    key.write_text(public.stdout)
    verified = cli.run("audit", "verify", "--window", str(window), "--public-key", str(key), timeout=120)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    actions = [json.loads(line).get("action") for line in window.read_text().splitlines()]
    for action in ("data.add", "adapters.deploy", "settings.set", "settings.apply", "chat.completions"):
        assert action in actions, action
    lines = window.read_text().splitlines()
    tampered = tmp_path / "tampered.jsonl"
    tampered.write_text("\n".join(lines[:1] + lines[2:]) + "\n")  # one record dropped
    refused = cli.run("audit", "verify", "--window", str(tampered), "--public-key", str(key), timeout=120)
    assert refused.returncode != 0 and "FAILED" in refused.stdout + refused.stderr
