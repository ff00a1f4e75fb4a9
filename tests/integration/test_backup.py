"""An appliance's life across an upgrade and a disaster, with an appliance of its own: installed on
Keycloak's dev-file database, it moves to PostgreSQL at `up` keeping its users' passwords and the
gateway client's secret; a backup is taken while it serves; each kind of bad backup is refused
with the target left as it was; the backup restored into a fresh state directory starts, its
users log in, the API key made before the backup authenticates (revoked since on the lost host)
and the one made after does not, its adapter answers, its dataset checks out, its audit chain
verifies, and its scheduled backups go to the artifact store."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from appliance.adapters import AdapterState
from appliance.artifacts import artifact_store
from appliance.home import Home
from appliance.jobs import Hyperparameters
from appliance.records import config_sha256
from appliance.secrets import GATEWAY_CLIENT_SECRET, secret
from appliance.settings import load_settings
from finetune.adapters import register
from installer.keycloak_dist import data_dir, install_dir
from installer.postgres import postgres_made
from installer.realm import BOOTSTRAP_SECRET
from tests.integration.realm import Realm
from tests.support.appliances import NO_KEYCLOAK, Appliance, make_appliance, new_appliance, remove_appliance
from tests.support.models import random_adapter
from tests.support.ports import free_port
from tests.support.records import metrics
from tests.support.session import Running
from tests.support.state_modes import db_user_reads, modes_not_private, passages_closed, readable_by_db_user

pytestmark = pytest.mark.alone
MODEL = "SmolLM2-135M-Instruct"
PASSWORD = "mover-password-1"
PASSPHRASE = "a passphrase for the vault"


@pytest.fixture(scope="module")
def appliance(demo_model: Path, keycloak_dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Appliance]:
    """Installed as before PostgreSQL (dev-file), with a user, a registered adapter and a dataset, then stopped."""
    for appliance in make_appliance(demo_model, keycloak_dist, APPLIANCE_KEYCLOAK__DATABASE="dev-file",
                                    APPLIANCE_BACKUP_PASSPHRASE=PASSPHRASE):
        # Settings the restore must keep (the engine serving adapters among them).
        appliance.home.settings_file.write_text(
            '[cache]\nttl_s = 123.0\n\n[[pools]]\nname = "main"\nenable_lora = true\n')
        started = appliance.run("up")
        assert started.returncode == 0, started.stdout + started.stderr
        Realm(Running(appliance, "", 0.0)).ensure_user("mover", PASSWORD, ["user"])
        adapter = random_adapter(demo_model, tmp_path_factory.mktemp("adapter") / "adapter")
        store = artifact_store(load_settings(appliance.home.settings_file).artifacts, appliance.home)
        register(appliance.home, store, adapter, name="kept", base_model=MODEL,
                 base_config_sha256=config_sha256(json.loads((demo_model / "config.json").read_text())),
                 dataset="none", dataset_sha256="-", hyperparameters=Hyperparameters(),
                 state=AdapterState.REGISTERED, metrics=metrics())
        rows = tmp_path_factory.mktemp("data") / "codes.jsonl"
        rows.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Code {i}?"},
                                                          {"role": "assistant", "content": f"ZEBRA-{i}"}]}) + "\n"
                                for i in range(20)))
        added = appliance.run("data", "add", str(rows), "--name", "codes", timeout=300)
        assert added.returncode == 0, added.stdout + added.stderr
        assert appliance.run("down").returncode == 0
        yield appliance


def realm(appliance: Appliance) -> Realm:
    return Realm(Running(appliance, "", 0.0))


def test_an_upgrade_moves_keycloak_from_dev_file_to_postgres_keeping_users_and_secrets(
        appliance: Appliance) -> None:
    del appliance.env["APPLIANCE_KEYCLOAK__DATABASE"]  # the default now: postgres
    started = appliance.run("up")
    assert started.returncode == 0, started.stdout + started.stderr
    assert "moved Keycloak's realms" in started.stderr and "from dev-file to PostgreSQL" in started.stderr
    assert postgres_made(appliance.home) and not (data_dir(appliance.home) / "h2").exists()
    assert list(data_dir(appliance.home).glob("h2.moved-to-postgres-*"))  # kept for the operator
    on_postgres = realm(appliance)
    assert on_postgres.token("mover", PASSWORD)  # the password hash came over
    granted = httpx.post(f"{on_postgres.issuer}/protocol/openid-connect/token", verify=on_postgres.tls, data={
        "grant_type": "client_credentials", "client_id": "appliance-gateway",
        "client_secret": secret(appliance.home, GATEWAY_CLIENT_SECRET)}, timeout=60)
    assert granted.status_code == 200, granted.text  # the client's secret came over
    again = appliance.run("down"), appliance.run("up")  # once only: the next start moves nothing
    assert again[1].returncode == 0 and "moved" not in again[1].stderr


def log_admin_in(appliance: Appliance) -> None:
    """The CLI logged in as the realm's administrator (`appliance keys` goes through the admin API)."""
    login = appliance.run("token", "--user", "admin", "--password-stdin",
                          stdin=secret(appliance.home, BOOTSTRAP_SECRET) + "\n", timeout=60)
    assert login.returncode == 0, login.stderr


def make_key(appliance: Appliance, name: str) -> str:
    """A new API key of the user `mover`, its secret."""
    made = appliance.run("keys", "create", name, "--user", "mover", "--json", timeout=60)
    assert made.returncode == 0, made.stdout + made.stderr
    return str(json.loads(made.stdout)["secret"])


def status_with_key(appliance: Appliance, key: str) -> int:
    """The gateway's answer to a request made with API key `key`, once it has looked the key's
    owner up (a 503 while Keycloak has not answered it yet, just after a start)."""
    deadline = time.monotonic() + 60
    while True:
        answer = httpx.get(f"{realm(appliance).gateway}/v1/models", headers={"Authorization": f"Bearer {key}"},
                           timeout=60)
        if answer.status_code != 503 or time.monotonic() > deadline:
            return answer.status_code
        time.sleep(1)


@pytest.fixture(scope="module")
def kept_key(appliance: Appliance) -> str:
    """An API key made before the backup (its secret), answered at the gateway."""
    log_admin_in(appliance)
    key = make_key(appliance, "kept-ci")
    assert status_with_key(appliance, key) == 200
    return key


@pytest.fixture(scope="module")
def taken(appliance: Appliance, kept_key: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A backup taken while users chat through the gateway (an API key made before it)."""
    served = realm(appliance)
    token = served.token("mover", PASSWORD)
    failures: list[str] = []
    stop = threading.Event()

    def chat() -> None:
        while not stop.is_set():
            answer = httpx.post(f"{served.gateway}/v1/chat/completions", headers={"Authorization": f"Bearer {token}"},
                                json={"model": MODEL, "max_tokens": 4,
                                      "messages": [{"role": "user", "content": "Hi"}]}, timeout=120)
            if answer.status_code != 200:
                failures.append(answer.text)

    chatting = threading.Thread(target=chat)
    chatting.start()
    try:
        path = tmp_path_factory.mktemp("backups") / "appliance.backup"
        created = appliance.run("backup", "create", "--out", str(path), timeout=600)
    finally:
        stop.set()
        chatting.join()
    assert created.returncode == 0, created.stdout + created.stderr
    assert "with Keycloak's PostgreSQL database" in created.stdout and not failures, failures
    return path


def test_a_backup_taken_while_serving_verifies(appliance: Appliance, taken: Path) -> None:
    verified = appliance.run("backup", "verify", str(taken))
    assert verified.returncode == 0 and "intact" in verified.stdout, verified.stdout + verified.stderr
    wrong = appliance.run("backup", "verify", str(taken), "--key-file", "/nonexistent")
    assert wrong.returncode == 1 and "cannot read key file /nonexistent" in wrong.stderr
    logged = appliance.run("audit", "tail", "--action", "backup.create")
    assert logged.returncode == 0 and str(taken) in logged.stdout, logged.stdout + logged.stderr


@pytest.fixture(scope="module")
def late_key(appliance: Appliance, taken: Path, kept_key: str) -> str:
    """After the backup: a new API key (its secret), and the key made before it revoked."""
    key = make_key(appliance, "late-ci")
    assert status_with_key(appliance, key) == 200
    revoked = appliance.run("keys", "revoke", "kept-ci", "--user", "mover", timeout=60)
    assert revoked.returncode == 0, revoked.stdout + revoked.stderr
    assert status_with_key(appliance, kept_key) == 401
    return key


@pytest.fixture(scope="module")
def restored(appliance: Appliance, taken: Path, late_key: str, keycloak_dist: Path,
             demo_model: Path) -> Iterator[Appliance]:
    """A new state directory on ports of its own, the backup refused in bad forms, then restored
    (Keycloak's database into a new cluster); the first appliance is stopped (a host that was lost)
    after an API key was made and another revoked there."""
    assert appliance.run("down").returncode == 0
    target = new_appliance(None)
    shutil.rmtree(target.home.root)  # nothing at all: a lost host's replacement
    for key in NO_KEYCLOAK:
        del target.env[key]
    target.env.update({f"APPLIANCE_KEYCLOAK__{name}": str(free_port())
                       for name in ("PORT", "MANAGEMENT_PORT", "POSTGRES_PORT")})
    key_file = taken.with_name("scheduled.key")
    key_file.write_text("a key file's contents, long enough\n")
    key_file.chmod(0o600)
    target.env.update({"APPLIANCE_BACKUP__EVERY_HOURS": "0.002", "APPLIANCE_BACKUP__KEEP": "2",  # every 7 s
                       "APPLIANCE_BACKUP__KEY_FILE": str(key_file)})
    whole = taken.read_bytes()
    bad = taken.with_name("bad.backup")
    for content, passphrase, message in [
        (whole[: len(whole) // 2], PASSPHRASE, "is cut short"),
        (whole, "not the passphrase at all", "wrong passphrase or key file"),
        (whole[:-1] + bytes([whole[-1] ^ 1]), PASSPHRASE, "is damaged or out of place"),
        (b"PK\x03\x04" + whole[4:], PASSPHRASE, "is not an appliance backup"),
    ]:
        bad.write_bytes(content)
        refused = target.run("backup", "restore", str(bad), stdin=passphrase + "\n")
        assert refused.returncode == 1 and message in refused.stderr, refused.stderr
        assert not target.home.root.exists(), "a refused restore leaves the target as it was"
    done = target.run("backup", "restore", str(taken), stdin=PASSPHRASE + "\n", timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"restored {taken} into {target.home.root}" in done.stdout
    install_dir(target.home).parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(keycloak_dist, install_dir(target.home), symlinks=True,
                    ignore=shutil.ignore_patterns("h2", "tmp"))
    target.home.demo_model.symlink_to(demo_model, target_is_directory=True)
    try:
        started = target.run("up")
        assert started.returncode == 0, started.stdout + started.stderr
        yield target
    finally:
        remove_appliance(target)


def test_the_restored_appliance_has_the_users_adapters_datasets_settings_and_audit(
        appliance: Appliance, restored: Appliance) -> None:
    assert restored.home.settings_file.read_bytes() == appliance.home.settings_file.read_bytes()
    again = realm(restored)
    token = again.token("mover", PASSWORD)
    login = restored.run("token", "--user", "admin", "--password-stdin",
                         stdin=secret(restored.home, BOOTSTRAP_SECRET) + "\n", timeout=60)
    assert login.returncode == 0, login.stderr
    deployed = restored.run("adapters", "deploy", "kept", timeout=300)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    answer = httpx.post(f"{again.gateway}/v1/chat/completions", headers={"Authorization": f"Bearer {token}"},
                        json={"model": "kept", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
                        timeout=120)
    assert answer.status_code == 200, answer.text
    shown = restored.run("data", "show", "codes")  # its files checked against its content hash
    assert shown.returncode == 0 and "ZEBRA" not in shown.stderr, shown.stdout + shown.stderr
    assert restored.run("data", "list", "--json").stdout == appliance.run("data", "list", "--json").stdout
    verified = restored.run("audit", "verify")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    restores = restored.run("audit", "tail", "--action", "backup.restore")
    assert restores.returncode == 0 and "backup.restore" in restores.stdout, restores.stdout + restores.stderr
    assert Home(restored.home.root).secrets.stat().st_mode & 0o777 == 0o700


def test_an_api_key_made_before_the_backup_authenticates_after_the_restore(
        restored: Appliance, kept_key: str, late_key: str) -> None:
    """The key registry and the secret its hashes are keyed with come back together, as they were
    at the backup: the key revoked since works again, the one made since is unknown."""
    assert status_with_key(restored, kept_key) == 200
    assert status_with_key(restored, late_key) == 401
    log_admin_in(restored)
    listed = restored.run("keys", "list", "--user", "mover", "--json", timeout=60)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert [(key["name"], key["state"]) for key in json.loads(listed.stdout)] == [("kept-ci", "active")]


def test_the_restored_state_directory_gives_the_database_user_nothing_but_its_own(
        appliance: Appliance, restored: Appliance) -> None:
    home = restored.home
    jobs = home.root / "finetune" / "jobs" / "jobs.sqlite"
    for private in (home.settings_file, jobs, home.secrets / GATEWAY_CLIENT_SECRET):
        assert private.is_file() and not db_user_reads(private), private
    assert readable_by_db_user(home) == []
    assert passages_closed(home) == {} and modes_not_private(home) == {}


def test_scheduled_backups_go_to_the_store_and_only_the_newest_are_kept(restored: Appliance) -> None:
    def listed() -> list[str]:
        shown = restored.run("backup", "list", "--json")
        assert shown.returncode == 0, shown.stderr
        return list(json.loads(shown.stdout)["backups"])

    seen: set[str] = set()
    deadline = time.monotonic() + 300
    while len(seen) < 3:  # three taken, never more than two kept
        assert time.monotonic() < deadline, f"scheduled backups seen: {sorted(seen)}"
        keys = listed()
        assert len(keys) <= 2, keys
        seen |= set(keys)
        time.sleep(1)
    newest = restored.home.root / "artifacts" / listed()[-1]
    key_file = restored.env["APPLIANCE_BACKUP__KEY_FILE"]
    verified = restored.run("backup", "verify", str(newest), "--key-file", key_file)
    assert verified.returncode == 0 and "intact" in verified.stdout, verified.stdout + verified.stderr
    scheduled = restored.run("audit", "tail", "--action", "backup.create", "--user", "backup-scheduler")
    assert scheduled.stdout.count("backup.create") >= 3, scheduled.stdout
