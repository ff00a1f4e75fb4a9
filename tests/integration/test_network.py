"""The gateway on the organisation's network, reached from a second network namespace (a stand-in
workstation that has only the CA certificate it was given): HTTPS with the appliance's CA and with
the organisation's certificate chain, a chat through the official `openai` client, plain HTTP and
an untrusting client refused, a certificate renewed under load with no failed request, and plain
HTTP on a network address refused at `up`.

The session appliance's gateway is restarted with network settings (its settings file; the
environment it was started with sets no bind) and given back as it was at the end."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import tomli_w

from appliance import tls
from appliance.local_gateway import client_options
from appliance.secrets import secret
from appliance.settings import load_settings
from appliance.supervisor import Supervisor
from installer.realm import BOOTSTRAP_SECRET, provision
from tests.integration.realm import Realm
from tests.support.appliances import new_appliance, remove_appliance
from tests.support.certificates import organisation_chain
from tests.support.netns import Network, veth_namespace
from tests.support.session import Running

pytestmark = pytest.mark.session_exclusive
MODEL = "SmolLM2-135M-Instruct"
PASSWORD = "net-user-password-1"


@pytest.fixture(scope="module")
def network() -> Iterator[Network]:
    with veth_namespace() as net:
        yield net


@pytest.fixture(scope="module")
def realm(running: Running) -> Realm:
    realm = Realm(running)
    realm.ensure_user("remote", PASSWORD, ["user"])
    return realm


@contextmanager
def gateway_settings(running: Running, **gateway: Any) -> Iterator[None]:
    """The session gateway restarted with `gateway` settings, then restarted as it was."""
    home = running.appliance.home
    original = home.settings_file.read_bytes() if home.settings_file.exists() else None
    data = tomllib.loads(original.decode()) if original else {}
    data.setdefault("gateway", {}).update(gateway)
    home.settings_file.write_text(tomli_w.dumps(data))
    try:
        provision(load_settings(home.settings_file, environ=running.appliance.env), home)  # as `up` does
        restart_gateway(running)
        yield
    finally:
        if original is None:
            home.settings_file.unlink()
        else:
            home.settings_file.write_bytes(original)
        provision(load_settings(home.settings_file, environ=running.appliance.env), home)
        restart_gateway(running)
        # Tokens issued meanwhile name the public URL as issuer: the modules after need a login
        # the restored gateway takes.
        local_cli_reaches_the_gateway(running)


def restart_gateway(running: Running) -> None:
    appliance = running.appliance
    supervisor = Supervisor(appliance.home)
    supervisor.call("stopProcess", "gateway", True)
    supervisor.call("startProcess", "gateway", True)
    settings = load_settings(appliance.home.settings_file, environ=appliance.env)
    deadline = time.monotonic() + 60
    with httpx.Client(**client_options(settings, appliance.home), timeout=5) as local:
        while True:
            try:
                if local.get("/healthz").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the gateway did not answer after its restart"
            time.sleep(0.2)


def workstation(net: Network, code: str, **env: str) -> Any:
    """Run `code` in the other namespace with this Python; what it prints last, as JSON."""
    done = subprocess.run(["ip", "netns", "exec", net.namespace, sys.executable, "-c", textwrap.dedent(code)],
                          env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


CHAT = """
    import json, os, httpx, openai
    http = httpx.Client(verify=os.environ["CA"], timeout=120)
    client = openai.OpenAI(base_url=os.environ["URL"] + "/v1", api_key=os.environ["TOKEN"], http_client=http)
    answer = client.chat.completions.create(model=os.environ["MODEL"], max_tokens=8, temperature=0,
                                            messages=[{"role": "user", "content": "Say hello."}])
    shown = {}
    with http.stream("GET", os.environ["URL"] + "/healthz") as response:
        der = response.extensions["network_stream"].get_extra_info("ssl_object").getpeercert(True)
        shown = {"version": response.extensions["network_stream"].get_extra_info("ssl_object").version()}
    from cryptography import x509
    from cryptography.x509.oid import NameOID
    leaf = x509.load_der_x509_certificate(der)
    shown["subject"] = leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    print(json.dumps({"text": answer.choices[0].message.content, "finish": answer.choices[0].finish_reason,
                      **shown}))
"""

REFUSED = """
    import json, os, httpx
    plain = os.environ["URL"].replace("https://", "http://")
    outcomes = {}
    for name, url, verify in (("plain", plain, False), ("untrusting", os.environ["URL"], True)):
        try:
            outcomes[name] = httpx.get(url + "/v1/models", verify=verify, timeout=10,
                                       headers={"Authorization": "Bearer " + os.environ["TOKEN"]}).status_code
        except httpx.HTTPError as exc:
            outcomes[name] = type(exc).__name__ + ": " + str(exc)[:200]
    print(json.dumps(outcomes))
"""

UNDER_LOAD = """
    import hashlib, json, os, socket, ssl, threading, time
    host, port = os.environ["HOST"], int(os.environ["PORT"])
    context = ssl.create_default_context(cafile=os.environ["CA"])
    request = ("GET /v1/models HTTP/1.1\\r\\nHost: %s\\r\\nAuthorization: Bearer %s\\r\\nConnection: close\\r\\n\\r\\n"
               % (host, os.environ["TOKEN"])).encode()
    seen, failures, answered = set(), [], [0]
    lock = threading.Lock()
    end = time.monotonic() + float(os.environ["SECONDS"])

    def client():
        while time.monotonic() < end:
            try:
                with socket.create_connection((host, port), timeout=30) as raw:
                    with context.wrap_socket(raw, server_hostname=host) as conn:
                        conn.sendall(request)
                        data = b""
                        while chunk := conn.recv(65536):
                            data += chunk
                        serial = hashlib.sha256(conn.getpeercert(True)).hexdigest()[:16]
                status = data.split(b" ", 2)[1]
                with lock:
                    seen.add(serial)
                    answered[0] += 1
                    if status != b"200":
                        failures.append(data[:200].decode(errors="replace"))
            except Exception as exc:
                with lock:
                    failures.append(repr(exc))

    threads = [threading.Thread(target=client) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(json.dumps({"answered": answered[0], "failures": failures[:5], "certificates": sorted(seen)}))
"""


def local_cli_reaches_the_gateway(running: Running) -> None:
    """The CLI on the appliance's host (as the batch worker and the RL loop do) reaches the gateway
    over HTTPS on loopback."""
    login = running.appliance.run("token", "--user", "admin", "--password-stdin", timeout=60,
                                  stdin=secret(running.appliance.home, BOOTSTRAP_SECRET) + "\n")
    assert login.returncode == 0, login.stdout + login.stderr
    listed = running.appliance.run("users", "list", "--json", timeout=60)
    assert listed.returncode == 0 and "admin" in listed.stdout, listed.stdout + listed.stderr


def test_https_with_the_appliance_ca_from_a_workstation(running: Running, realm: Realm, network: Network,
                                                        tmp_path: Path) -> None:
    home = running.appliance.home
    port = realm.settings.gateway.port
    url = f"https://{network.head}:{port}"
    ca = tmp_path / "appliance-ca.pem"
    shown = running.appliance.run("tls", "export-ca")
    assert shown.returncode == 0, shown.stderr
    ca.write_text(shown.stdout)  # all the workstation is given
    token = realm.token("remote", PASSWORD)
    with gateway_settings(running, bind="0.0.0.0", names=[network.head]):
        chat = workstation(network, CHAT, URL=url, CA=str(ca), TOKEN=token, MODEL=MODEL)
        assert chat["text"] and chat["finish"] in ("stop", "length")
        assert chat["subject"] == "appliance gateway" and chat["version"] in ("TLSv1.3", "TLSv1.2")
        refused = workstation(network, REFUSED, URL=url, TOKEN=token)
        assert refused["plain"] != 200 and "Error" in str(refused["plain"]), refused
        assert "CERTIFICATE_VERIFY_FAILED" in str(refused["untrusting"]), refused

        # Renewed under load (as the administrator, whose budget the load does not reach): every
        # request answered, and the new certificate served after.
        load = subprocess.Popen(
            ["ip", "netns", "exec", network.namespace, sys.executable, "-c", textwrap.dedent(UNDER_LOAD)],
            env={"PATH": "/usr/bin:/bin", "HOST": network.head, "PORT": str(port), "CA": str(ca),
                 "TOKEN": realm.admin_token(), "SECONDS": "8"},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(2)  # the load is running on the first certificate
        renewed = running.appliance.run("tls", "renew")
        assert renewed.returncode == 0 and "renewed" in renewed.stdout, renewed.stdout + renewed.stderr
        out, err = load.communicate(timeout=120)
        assert load.returncode == 0, err
        result = json.loads(out.strip().splitlines()[-1])
        assert result["failures"] == [] and result["answered"] > 20, result
        assert len(result["certificates"]) == 2, result  # the first, then the renewed one
        local_cli_reaches_the_gateway(running)
    assert tls.ca_file(home).read_text() == ca.read_text()  # one CA: it did not change with the renewal


def test_https_with_the_organisations_chain(running: Running, realm: Realm, network: Network,
                                            tmp_path: Path) -> None:
    chain = organisation_chain(tmp_path / "pki", ["llm.bank.test", network.head])
    port = realm.settings.gateway.port
    token = realm.token("remote", PASSWORD)
    with gateway_settings(running, bind="0.0.0.0", certificate=str(chain.certificate),
                          private_key=str(chain.private_key)):
        chat = workstation(network, CHAT, URL=f"https://{network.head}:{port}", CA=str(chain.root), TOKEN=token,
                           MODEL=MODEL)
        assert chat["text"] and chat["subject"] == "llm.bank.test"
        # The appliance's own clients verify the CA's certificate, asked for as localhost.
        local_cli_reaches_the_gateway(running)


def test_plain_http_on_a_network_address_is_refused_at_up() -> None:
    appliance = new_appliance(None, APPLIANCE_GATEWAY__BIND="0.0.0.0", APPLIANCE_GATEWAY__TLS="off")
    try:
        refused = appliance.run("up", timeout=120)
        assert refused.returncode != 0
        assert "APPLIANCE_GATEWAY__BIND" in refused.stderr and "in clear" in refused.stderr, refused.stderr
        assert not (appliance.home.run / "supervisord.pid").exists()
    finally:
        remove_appliance(appliance)


DEVICE_APPROVAL = """
    import json, os, ssl, sys
    sys.path.insert(0, os.environ["REPO"])
    from tests.support.browser import approve_device_login
    page = approve_device_login(os.environ["LINK"], os.environ["USER_NAME"], os.environ["PASSWORD"],
                                ssl.create_default_context(cafile=os.environ["CA"]))
    print(json.dumps({"page": page[-300:]}))
"""

TUI_FIRST_SCREEN = """
    import json, os, sys
    sys.path.insert(0, os.environ["REPO"])
    from appliance.home import Home
    from appliance.settings import Settings
    from tests.support.pilot import drive, rows, until
    from tui.app import AdminApp

    app = AdminApp(Settings(), Home.from_env().ensure())
    seen = {}

    async def scenario(pilot):
        await until(pilot, lambda: "gateway" in rows(app, "services"), "the dashboard", 120)
        seen.update(services=sorted(rows(app, "services")), title=app.sub_title)

    drive(app, scenario)
    print(json.dumps(seen))
"""


def test_logins_and_the_tui_from_a_workstation(running: Running, realm: Realm, network: Network,
                                                tmp_path: Path) -> None:
    """A workstation with only the CA certificate: a password login and a device login approved
    through the published verification page, admin commands and the TUI's first screen, all
    through the gateway; its logins are its own (its user's configuration directory)."""
    port = realm.settings.gateway.port
    public = f"https://{network.head}:{port}"
    ca = tmp_path / "appliance-ca.pem"
    ca.write_text(running.appliance.run("tls", "export-ca").stdout)
    desk = tmp_path / "workstation"
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(desk),
           "XDG_CONFIG_HOME": str(desk / "config"), "APPLIANCE_HOME": str(desk / "state"), "COLUMNS": "200",
           "REPO": str(Path(__file__).parents[2])}
    admin_password = secret(running.appliance.home, BOOTSTRAP_SECRET)

    def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", network.namespace, str(Path(sys.executable).parent / "appliance"),
                               *args], env=env, input=stdin, capture_output=True, text=True, timeout=180)

    with gateway_settings(running, bind="0.0.0.0", public_url=public):
        # Keycloak's admin console and the master realm are not published.
        hidden = workstation(network, """
            import json, os, httpx
            base = os.environ["URL"]
            print(json.dumps({path: httpx.get(base + path, verify=os.environ["CA"]).status_code
                              for path in ("/admin/master/console/", "/realms/master/protocol/openid-connect/certs",
                                           "/realms/appliance/protocol/openid-connect/certs")}))
        """, URL=public, CA=str(ca))
        assert hidden == {"/admin/master/console/": 401, "/realms/master/protocol/openid-connect/certs": 404,
                          "/realms/appliance/protocol/openid-connect/certs": 200}, hidden

        logged = cli("token", "--gateway", public, "--ca-file", str(ca), "--user", "remote", "--password-stdin",
                     stdin=PASSWORD + "\n")
        assert logged.returncode == 0, logged.stdout + logged.stderr
        assert f"logged in as remote at {public}" in logged.stdout, logged.stdout
        who = cli("whoami", "--json")
        view = json.loads(who.stdout)
        assert view["issuer"] == f"{public}/realms/appliance" and view["gateway"] == public, view
        cache = Path(view["cache"])
        assert cache.is_relative_to(desk / "config") and cache.stat().st_mode & 0o777 == 0o600
        refused = cli("users", "list")
        assert refused.returncode != 0 and "403" in refused.stderr, refused.stderr  # remote is no administrator

        # The device login, approved in the workstation's browser through the published page.
        device = subprocess.Popen(["ip", "netns", "exec", network.namespace,
                                   str(Path(sys.executable).parent / "appliance"), "token"],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert device.stderr is not None
        prompt = device.stderr.readline()
        link = prompt.split("Open ", 1)[1].split(" and enter", 1)[0]
        assert link.startswith(f"{public}/realms/appliance/device"), prompt
        workstation(network, DEVICE_APPROVAL, LINK=link, USER_NAME="admin", PASSWORD=admin_password, CA=str(ca),
                    REPO=env["REPO"])
        out, err = device.communicate(timeout=120)
        assert device.returncode == 0 and "logged in as admin" in out, out + err
        listed = cli("users", "list", "--json")
        assert listed.returncode == 0 and "remote" in listed.stdout, listed.stdout + listed.stderr

        first = workstation(network, TUI_FIRST_SCREEN, **{k: v for k, v in env.items() if k != "PATH"})
        assert "gateway" in first["services"] and first["title"] == f"admin @ {public}", first

        back = cli("token", "--gateway", "local", "--print")  # this workstation has no appliance of its own
        assert back.returncode != 0
    # The host's own CLI kept its own login all along (another user's configuration directory).
    assert not (Path(running.appliance.env["XDG_CONFIG_HOME"]) / "appliance" / "remote.json").exists()
