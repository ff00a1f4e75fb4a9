"""Air-gapped install, for real: a bundle built here (carrying a given model: a tiny
Qwen3-MoE made by the test) installs into a fresh directory inside a network namespace that
holds nothing but loopback; there `appliance up` starts (Keycloak on the bundle's PostgreSQL, the
gateway on HTTPS), a user is added and a chat completion answers through the gateway, an adapter
is registered and a backup is taken while it serves. A newer bundle installed over it (also
offline) upgrades the software and leaves settings, secrets, the audit log and adapters untouched,
and the audit chain verifies; the backup restored into a fresh state directory with the newer
software starts, and the user it holds chats over HTTPS.

The engine started here also serves the check of the planner's KV capacity for an MoE
against what vLLM reports (one vLLM start for both, to keep the suite within CI's time)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from appliance.engine_launch import resolve_device, resolve_dtype
from appliance.settings import Settings
from installer.bundle import MANIFEST, PUBLIC_KEY, SIGNATURE, load_or_create_key, seal
from installer.bundle_files import SUMS, SUMS_SIGNATURE
from installer.memory import GIB, Layout, kv_bytes_per_token
from installer.model_config import DTYPE_BYTES, load_model_config
from tests.support.appliances import APPLIANCE
from tests.support.models import random_adapter, tiny_moe

PROJECT = Path(__file__).resolve().parents[2]
MODEL = "tiny-moe"
KEPT = ("settings.toml", "secrets", "adapters.json", "artifacts")
PASSPHRASE = "the passphrase of the bundle test"

# Run inside the namespace with the installed software only (not this checkout's).
CHAT = """
import ssl, sys, httpx
issuer, ca, user, password = sys.argv[1:5]  # the gateway serves HTTPS (gateway.tls = "on") with the same CA
token = httpx.post(f"{issuer}/protocol/openid-connect/token", data={"grant_type": "password",
    "client_id": "appliance-cli", "username": user, "password": password}, timeout=60,
    verify=ssl.create_default_context(cafile=ca)).json()["access_token"]
answer = httpx.post("https://localhost:8080/v1/chat/completions", headers={"Authorization": f"Bearer {token}"},
    json={"model": "tiny-moe", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]},
    timeout=300, verify=ssl.create_default_context(cafile=ca))
print("CHAT", answer.status_code, answer.json()["choices"][0]["message"]["content"].replace("\\n", " "))
"""
ADAPTER = """
import json, sys
from pathlib import Path
from appliance.adapters import AdapterMetrics, AdapterState
from appliance.artifacts import artifact_store
from appliance.home import Home
from appliance.jobs import Hyperparameters
from appliance.records import config_sha256
from appliance.settings import load_settings
from finetune.adapters import register
home = Home.from_env()
record = register(home, artifact_store(load_settings(home.settings_file).artifacts, home), Path(sys.argv[1]),
    name="kept-adapter", base_model="tiny-moe", dataset="none", dataset_sha256="-",
    base_config_sha256=config_sha256(json.loads((home.root / "models/tiny-moe/config.json").read_text())),
    hyperparameters=Hyperparameters(), state=AdapterState.REGISTERED, metrics=AdapterMetrics(
        base_eval_loss=1.5, adapter_eval_loss=1.2, improvement=0.2, steps=4, train_tokens=512, seconds=1.0))
print("ADAPTER", record.name, record.version)
"""


def check_moe_kv_capacity(state: Path, moe: Path, record_property: pytest.RecordProperty) -> None:
    """The planner's KV capacity for the MoE against what the engine reported at start."""
    log = (state / "logs" / "vllm-main.log").read_text()
    reported = int(re.findall(r"KV cache size: ([\d,]+) tokens", log)[-1].replace(",", ""))
    shape = load_model_config(moe)
    assert shape.is_moe and shape.experts.routed == 4
    engine = Settings().engine  # the KV cache is held in the engine's dtype (float32 on the CPU engine)
    kv_bytes = DTYPE_BYTES[resolve_dtype(engine, resolve_device(engine))]
    predicted = engine.cpu_kvcache_gib * GIB // kv_bytes_per_token(shape, Layout(), kv_bytes)
    difference = predicted / reported - 1
    record_property("kv_capacity_moe", {"predicted": predicted, "vllm": reported, "difference": difference})
    print(f"tiny MoE KV capacity: planner {predicted:,} tokens, vLLM {reported:,} tokens ({difference:+.2%})")
    # The budget (whole GiB) over 2,048 bytes a token (float32, two layers of two KV heads of 64)
    # is whole blocks of 128 tokens, so vLLM's paging rounds nothing off: the capacities are equal.
    assert reported == predicted, (predicted, reported)


def audit_records(state: Path) -> list[dict]:
    return [json.loads(line) for path in sorted((state / "audit").glob("audit-*.jsonl"))
            for line in path.read_text().splitlines()]


def tree_digest(root: Path, names: tuple[str, ...]) -> dict[str, str]:
    """SHA-256 of every file under `root`/name for each name (a file or a directory)."""
    found = {}
    for name in names:
        for path in sorted([root / name] if (root / name).is_file() else (root / name).rglob("*")):
            if path.is_file():
                found[path.relative_to(root).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def in_namespace(script: str, timeout_s: float = 900) -> subprocess.CompletedProcess[str]:
    """`script` (bash) in a new network namespace with only loopback, brought up."""
    isolate = ["unshare", "--net", *([] if os.geteuid() == 0 else ["--map-root-user"])]
    clean = {key: value for key, value in os.environ.items()
             if not key.startswith(("APPLIANCE_", "VIRTUAL_ENV", "PYTHON"))} | {"COLUMNS": "300"}
    # From /: nothing of this checkout (its packages, its egg-info) may be picked up instead.
    return subprocess.run([*isolate, "bash", "-c", f"set -euo pipefail; ip link set lo up; {script}"],
                          capture_output=True, text=True, timeout=timeout_s, env=clean, cwd="/")


def newer_bundle(old: Path, new: Path, key_file: Path, work: Path) -> str:
    """`old` with the appliance's wheel rebuilt as the next version, re-signed: what a later
    `bundle build` of a newer checkout holds (the other wheels, Keycloak and the model unchanged)."""
    subprocess.run(["cp", "-al", str(old), str(new)], check=True)  # hard links: no copy of 3.6 GB
    for name in (MANIFEST, SIGNATURE, PUBLIC_KEY, SUMS, SUMS_SIGNATURE):
        (new / name).unlink()  # rewritten by seal(); unlinked first so `old` keeps its own
    [wheel] = (new / "wheels").glob("appliance-*.whl")
    wheel.unlink()
    source = work / "source"
    files = subprocess.run(["git", "ls-files"], cwd=PROJECT, capture_output=True, text=True, check=True).stdout
    for name in files.split():
        if (PROJECT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(PROJECT / name, source / name)
    pyproject = source / "pyproject.toml"
    pyproject.write_text(re.sub(r'(?m)^version = "([^"]+)"', r'version = "\1.post1"', pyproject.read_text()))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(new / "wheels"), str(source)], check=True, capture_output=True)
    old_manifest = json.loads((old / MANIFEST).read_text())
    seal(new, load_or_create_key(key_file), description={k: v for k, v in old_manifest.items()
                                                           if k not in ("files", "created", "format")})
    [built] = (new / "wheels").glob("appliance-*.whl")
    return built.name.split("-")[1]


def test_bundle_installs_and_serves_with_no_network_and_upgrades_keeping_state(
        tmp_path: Path, demo_model: Path, record_property: pytest.RecordProperty) -> None:
    key_file = tmp_path / "signing-key.pem"
    moe = tiny_moe(tmp_path / MODEL, demo_model)
    # The install and state dirs where PostgreSQL's user may pass (pytest's temp dirs are closed to others).
    homes = Path(tempfile.mkdtemp(prefix="bundle-homes-", dir="/tmp"))
    homes.chmod(0o711)
    first, prefix, state, restored = tmp_path / "bundle-1", homes / "opt", homes / "state", homes / "restored"
    env = {k: v for k, v in os.environ.items() if k != "APPLIANCE_HOME"}  # caches of the default state dir
    started = time.monotonic()
    built = subprocess.run([APPLIANCE, "bundle", "build", "--out", str(first), "--key", str(key_file),
                            "--model", str(moe)],
                           capture_output=True, text=True, timeout=1200, env={**env, "COLUMNS": "300"})
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr
    build_s = time.monotonic() - started
    printed = re.search(r"fingerprint \(compare it out of band on the target\): (\S+)", built.stdout).group(1)

    devices = in_namespace("ip -o link show | cut -d: -f2")
    assert devices.stdout.split() == ["lo"], devices.stdout  # nothing to reach but ourselves

    trusted = tmp_path / "builder.pub"  # the operator's copy of the builder's public key
    trusted.write_bytes(load_or_create_key(key_file).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    assert trusted.read_text() in built.stdout, "the build prints the public key to carry out of band"
    # The printed commands (openssl, sha256sum) verify the bundle before any script of it runs.
    commands = re.findall(r"^  ((?:openssl|base64|\(cd).*?)(?:   # .*)?$", built.stdout, re.MULTILINE)
    assert len(commands) == 3, built.stdout[-2000:]
    checked = in_namespace(f"cd {tmp_path} && set -o pipefail && " + " && ".join(commands))
    assert checked.returncode == 0 and printed.replace(":", "") in checked.stdout, checked.stdout + checked.stderr
    assert "Signature Verified Successfully" in checked.stdout
    started = time.monotonic()
    installed = in_namespace(f"bash {first}/install.sh {first} --prefix {prefix} --home {state} --key {trusted}")
    install_s = time.monotonic() - started
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    assert f"signed by the trusted key: {printed}" in installed.stdout
    assert f"the bundle's model is in {state}/models/" in installed.stdout  # not the demo: the operator names it
    (state / "settings.toml").write_text(f'[gateway]\ntls = "on"\n\n'
                                         f'[[pools]]\nname = "main"\nmodel = "{state}/models/{MODEL}"\n')
    app, python = prefix / "venv/bin/appliance", prefix / "venv/bin/python"
    issuer = "https://127.0.0.1:8180/realms/appliance"
    (tmp_path / "chat.py").write_text(CHAT)
    (tmp_path / "adapter.py").write_text(ADAPTER)
    adapter = random_adapter(moe, tmp_path / "adapter")

    second = tmp_path / "bundle-2"
    with ThreadPoolExecutor(1) as background:  # the next bundle is made while the appliance runs
        newer = background.submit(newer_bundle, first, second, key_file, tmp_path)
        first_run = in_namespace(f"""
        export APPLIANCE_HOME={state}
        {app} up
        {app} token --user admin --password-stdin < {state}/secrets/bootstrap-admin-password
        {app} users add carol --role user --password-stdin <<< 'Carol-password-1'
        {python} {tmp_path}/chat.py {issuer} {state}/tls/ca.pem carol Carol-password-1
        {python} {tmp_path}/adapter.py {adapter}
        APPLIANCE_BACKUP_PASSPHRASE="{PASSPHRASE}" {app} backup create --out {homes}/state.backup
        {app} down""")
        new_version = newer.result()
    assert first_run.returncode == 0, first_run.stdout[-3000:] + first_run.stderr[-3000:]
    assert re.search(r"^CHAT 200 .*\S", first_run.stdout, re.MULTILINE), first_run.stdout[-2000:]
    assert "ADAPTER kept-adapter 1" in first_run.stdout
    assert "with Keycloak's PostgreSQL database" in first_run.stdout, first_run.stdout[-2000:]
    check_moe_kv_capacity(state, moe, record_property)
    kept = tree_digest(state, KEPT)
    assert (state / "postgres" / "data" / "PG_VERSION").is_file()  # the users' database
    records = audit_records(state)
    assert any(r["action"] == "users.add" and r["outcome"] == "allowed" for r in records)

    started = time.monotonic()
    refused = in_namespace(f"bash {second}/install.sh {second} --prefix {prefix} --home {state}")
    assert refused.returncode == 1 and "say which key to trust" in refused.stderr
    upgraded = in_namespace(f"bash {second}/install.sh {second} --prefix {prefix} --home {state} "
                            f"--fingerprint {printed}")
    upgrade_s = time.monotonic() - started
    assert upgraded.returncode == 0, upgraded.stdout[-3000:] + upgraded.stderr[-3000:]
    after = in_namespace(f"""
        export APPLIANCE_HOME={state}
        {python} -c 'import importlib.metadata as m; print("VERSION", m.version("appliance"))'
        {python} -c 'from appliance import adapters, home; \
print("ADAPTERS", [r.name for r in adapters.load(home.Home.from_env()).adapters])'
        {app} audit verify""")
    assert after.returncode == 0, after.stdout[-3000:] + after.stderr[-3000:]
    assert f"VERSION {new_version}" in after.stdout and new_version.endswith(".post1")
    assert "ADAPTERS ['kept-adapter']" in after.stdout
    assert re.search(r"audit log OK \(.*\): \d+ records", after.stdout), after.stdout[-2000:]
    assert tree_digest(state, KEPT) == kept  # byte for byte: settings, secrets, users, adapters
    assert audit_records(state)[:len(records)] == records  # the trail kept; the install's own steps appended

    # A lost host: the backup restored into a fresh state dir with the newer software, Keycloak
    # installed there from the bundle, then up; the user it holds logs in and chats over HTTPS.
    again = in_namespace(f"""
        export APPLIANCE_HOME={restored}
        {app} backup restore {homes}/state.backup <<< '{PASSPHRASE}'
        cp {second}/keycloak/*.zip {restored}/cache/
        {app} keycloak install
        {app} up
        {python} {tmp_path}/chat.py {issuer} {restored}/tls/ca.pem carol Carol-password-1
        {app} audit verify
        {app} down""")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert re.search(r"^CHAT 200 .*\S", again.stdout, re.MULTILINE), again.stdout[-2000:]
    assert f"restored {homes}/state.backup into {restored}" in again.stdout

    sizes = dict(re.findall(r"(wheels|keycloak|model|scripts) ([\d,.]+) MiB", built.stdout))
    print(f"\nbundle: {sizes} MiB; build {build_s:.0f} s, install {install_s:.0f} s, upgrade {upgrade_s:.0f} s")
    for big in (first, second, prefix, homes):  # 10 GB between them; pytest keeps its last three temp dirs
        shutil.rmtree(big)
