"""The admin API and the CLI that uses it: token login, users, services."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from appliance.secrets import secret
from installer.realm import BOOTSTRAP_SECRET
from tests.integration.conftest import Running
from tests.integration.realm import Realm
from tests.support.appliances import APPLIANCE, Appliance
from tests.support.browser import approve_device_login


@pytest.fixture(scope="module")
def realm(running: Running) -> Realm:
    return Realm(running)


def admin_get(realm: Realm, path: str, token: str | None = None) -> httpx.Response:
    token = token or realm.admin_token()
    return httpx.get(f"{realm.gateway}/admin{path}", headers={"Authorization": f"Bearer {token}"}, timeout=60)


def test_cli_token_login_and_users_round_trip(running: Running, realm: Realm) -> None:
    cli = running.appliance
    wrong = cli.run("token", "--user", "admin", "--password-stdin", stdin="wrong\n", timeout=60)
    assert wrong.returncode == 1 and "Keycloak refused the login" in wrong.stderr
    password = secret(cli.home, BOOTSTRAP_SECRET)
    login = cli.run("token", "--user", "admin", "--password-stdin", stdin=password + "\n", timeout=60)
    assert login.returncode == 0, login.stderr
    assert cli.login_cache().stat().st_mode & 0o777 == 0o600
    assert password not in login.stdout + login.stderr
    printed = cli.run("token", "--print", timeout=60).stdout.strip()
    assert printed.count(".") == 2

    added = cli.run("users", "add", "dave", "--role", "user", "--role", "trainer", timeout=60)
    assert added.returncode == 0, added.stderr
    generated = added.stdout.split("generated password (shown once): ")[1].split()[0]
    assert realm.token("dave", generated)
    again = cli.run("users", "add", "dave", "--role", "user", timeout=60)
    assert again.returncode == 1 and "409" in again.stderr
    bad_role = cli.run("users", "add", "erin", "--role", "superuser", timeout=60)
    assert bad_role.returncode == 2 and "--role" in bad_role.stderr and "superuser" in bad_role.stderr, \
        "refused by the CLI itself (a usage error), naming the option and the value"

    listed = cli.run("users", "list", timeout=60)
    assert "dave" in listed.stdout and "trainer" in listed.stdout
    assert cli.run("users", "list-roles", timeout=60).stdout.split() == ["admin", "user", "trainer", "auditor",
                                                                         "rl-policy"]
    disabled = cli.run("users", "disable", "dave", timeout=60)
    assert disabled.returncode == 0
    users = {u["username"]: u for u in admin_get(realm, "/users").json()}
    assert users["dave"]["enabled"] is False


def test_admin_routes_need_the_admin_role(realm: Realm) -> None:
    realm.ensure_user("frank", "Test-password-1", ["user"])
    user_token = realm.token("frank", "Test-password-1")
    response = admin_get(realm, "/services", token=user_token)
    assert response.status_code == 403 and response.json()["error"]["code"] == "missing_role"
    assert httpx.get(f"{realm.gateway}/admin/services").status_code == 401


def test_admin_sees_services_settings_and_pools(realm: Realm) -> None:
    services = {s["name"]: s for s in admin_get(realm, "/services").json()}
    assert set(services) == {"postgres", "keycloak", "vllm-main", "gateway", "finetune-worker", "rl-worker",
                             "batch-worker", "prometheus", "alertmanager", "watchdog"}
    assert all(s["state"] == "RUNNING" and s["pid"] > 0 for s in services.values())
    settings = admin_get(realm, "/settings").json()
    assert settings["gateway"]["port"] == int(realm.running.appliance.env["APPLIANCE_GATEWAY__PORT"])
    text = json.dumps(settings)
    for name in ("engine-api-key", "gateway-client-secret", "supervisor-password", "postgres-keycloak"):
        assert secret(realm.running.appliance.home, name) not in text
    [pool] = admin_get(realm, "/pools").json()
    assert pool["name"] == "main" and pool["healthy"] is True
    refused = httpx.post(f"{realm.gateway}/admin/services/gateway/stop",
                         headers={"Authorization": f"Bearer {realm.admin_token()}"})
    assert refused.status_code == 409
    missing = httpx.post(f"{realm.gateway}/admin/services/nope/restart",
                         headers={"Authorization": f"Bearer {realm.admin_token()}"})
    assert missing.status_code == 404


def test_openapi_lists_every_route_with_models(realm: Realm) -> None:
    spec = httpx.get(f"{realm.gateway}/openapi.json").json()
    for path in ("/v1/models", "/v1/chat/completions", "/v1/completions", "/healthz", "/readyz",
                 "/metrics", "/admin/services", "/admin/users", "/admin/settings", "/admin/pools", "/admin/adapters",
                 "/admin/adapters/{name}/deploy", "/admin/adapters/{name}/canary", "/admin/adapters/{name}/rollback",
                 "/admin/adapters/{name}/retire"):
        assert path in spec["paths"], path
    assert {"NewUser", "DeployRequest", "CanaryRequest", "RetireRequest", "Alias", "Registry"} <= set(
        spec["components"]["schemas"])
    assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"


def test_device_code_login_and_refresh(running: Running, realm: Realm, tmp_path: Path) -> None:
    realm.ensure_user("gina", "Test-password-1", ["user"])
    # A login cache of its own: the session appliance's is the administrator's, which modules
    # running beside this one use meanwhile (logged in as gina, they were refused).
    cli = Appliance(home=running.appliance.home, env={**running.appliance.env, "XDG_CONFIG_HOME": str(tmp_path)})
    process = subprocess.Popen([APPLIANCE, "token"], env=cli.env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        prompt = process.stderr.readline()
        url, code = re.search(r"Open (\S+) and enter the code (\S+) ", prompt).groups()
        assert code in url
        page = approve_device_login(url, "gina", "Test-password-1", realm.tls)
        assert "Device Login Successful" in page or "successful" in page.lower(), page[:300]
        stdout, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 0, stderr
    assert "logged in as gina" in stdout

    # An expiring cached token is refreshed, not reused.
    cache = cli.login_cache()
    cached = json.loads(cache.read_text())
    cache.write_text(json.dumps({**cached, "expires_at": time.time()}))
    refreshed = cli.run("token", "--print", timeout=60).stdout.strip()
    assert refreshed and refreshed != cached["access_token"]
    assert json.loads(cache.read_text())["expires_at"] > time.time() + 60
