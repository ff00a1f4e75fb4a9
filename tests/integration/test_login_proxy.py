"""Keycloak's login endpoints published through the real gateway to two clients at once, against the
session appliance's real Keycloak: a browser that has logged in as the administrator (Keycloak's
single sign-on cookies in its jar), and a second client that starts with no cookie. Whatever the
browser did first, the second client's password login, device login, refresh and logout stay its
own: its device login shows it Keycloak's login form (no single sign-on as the administrator), and
every token it gets names its own user.
Beside them: only the appliance's client has login pages here, a body past its route's bound is a
413, the device login ends on its status page, and a source guessing passwords is throttled (429,
recorded in the audit log) while Keycloak's lockout stays temporary.

The session appliance's gateway is restarted with a public URL on this host (the helpers of
test_network) and given back as it was at the end."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from appliance.secrets import secret
from audit.writer import log_files
from installer.realm import BOOTSTRAP_SECRET
from serve.keycloak_http import no_cookies
from tests.integration.realm import Realm
from tests.integration.test_network import gateway_settings
from tests.support.browser import browse, form_action
from tests.support.session import Running

pytestmark = pytest.mark.session_exclusive
PASSWORD = "proxy-user-password-1"
WRONG = "not-the-password-1"


@pytest.fixture(scope="module")
def realm(running: Running) -> Realm:
    realm = Realm(running)
    realm.ensure_user("proxied", PASSWORD, ["user"])
    return realm


@pytest.fixture(scope="module")
def ca(running: Running, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ca") / "appliance-ca.pem"
    path.write_text(running.appliance.run("tls", "export-ca").stdout)
    return path


def public_url(realm: Realm) -> str:
    return f"https://127.0.0.1:{realm.settings.gateway.port}"


class Published:
    """The realm's endpoints as a workstation reaches them: through the gateway's public URL."""

    def __init__(self, public: str, ca: Path) -> None:
        self.realm = f"{public}/realms/appliance"
        self.ca = str(ca)

    def client(self, *, keeps_cookies: bool = True) -> httpx.Client:
        """A browser (its own jar, empty to begin with), or a script that keeps no cookie."""
        return httpx.Client(verify=self.ca, timeout=60, cookies=None if keeps_cookies else no_cookies())

    def token(self, client: httpx.Client, **form: str) -> httpx.Response:
        return client.post(f"{self.realm}/protocol/openid-connect/token", data={"client_id": "appliance-cli", **form})

    def device_login(self, client: httpx.Client) -> dict[str, Any]:
        answer = client.post(f"{self.realm}/protocol/openid-connect/auth/device", data={"client_id": "appliance-cli"})
        assert answer.status_code == 200, answer.text
        started: dict[str, Any] = answer.json()
        assert started["verification_uri"] == f"{self.realm}/device", started
        return started

    def approve(self, client: httpx.Client, link: str, username: str, password: str) -> httpx.Response:
        """Open the link, sign in if Keycloak asks, consent; the last page."""
        page = browse(client, "GET", link)
        if 'id="kc-form-login"' in page.text:
            page = browse(client, "POST", form_action(page, "kc-form-login"),
                          data={"username": username, "password": password, "credentialId": ""})
        assert 'name="accept"' in page.text, page.text[-500:]
        return browse(client, "POST", form_action(page, None), data={"accept": "Yes"})

    def poll(self, client: httpx.Client, device_code: str) -> dict[str, Any]:
        answer = self.token(client, grant_type="urn:ietf:params:oauth:grant-type:device_code", device_code=device_code)
        assert answer.status_code == 200, answer.text
        body: dict[str, Any] = answer.json()
        return body


def user_of(token: str) -> str:
    payload = token.split(".")[1]
    return str(json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))["preferred_username"])


@pytest.fixture(scope="module")
def published(running: Running, realm: Realm, ca: Path) -> Iterator[Published]:
    """The gateway with a public URL on this host, and throttling wide enough for the flows."""
    with gateway_settings(running, bind="0.0.0.0", public_url=public_url(realm), login_burst=1000,
                          login_attempts_per_minute=6000):
        yield Published(public_url(realm), ca)


@pytest.fixture(scope="module")
def browser(published: Published, running: Running) -> Iterator[httpx.Client]:
    """A browser that approved a device login as the administrator: Keycloak's SSO cookies are in
    its jar (and, before the fix, were in the gateway's)."""
    with published.client() as client:
        started = published.device_login(client)
        done = published.approve(client, started["verification_uri_complete"], "admin",
                                 secret(running.appliance.home, BOOTSTRAP_SECRET))
        assert done.url.path == "/realms/appliance/device/status", done.url  # forwarded, not a 404
        assert done.status_code == 200 and "go back to your device" in done.text, done.text[-300:]
        assert user_of(published.poll(client, started["device_code"])["access_token"]) == "admin"
        assert "KEYCLOAK_IDENTITY" in {cookie.name for cookie in client.cookies.jar}, "signed in"
        yield client


def device_flow(published: Published, browser: httpx.Client, other: httpx.Client) -> None:
    """Interleaved: the other client starts a device login; the browser, signed in, approves one
    of its own; the other client opens its link with no cookie yet: Keycloak's login form, not a
    consent as the administrator; it signs in as itself; each poll gets its own user's token."""
    mine = published.device_login(other)
    theirs = published.device_login(browser)
    published.approve(browser, theirs["verification_uri_complete"], "admin", "")  # SSO: no password asked
    page = browse(other, "GET", mine["verification_uri_complete"])
    assert 'id="kc-form-login"' in page.text and 'name="accept"' not in page.text, page.text[-500:]
    done = published.approve(other, mine["verification_uri_complete"], "proxied", PASSWORD)
    assert done.url.path == "/realms/appliance/device/status" and done.status_code == 200
    assert user_of(published.poll(other, mine["device_code"])["access_token"]) == "proxied"
    assert user_of(published.poll(browser, theirs["device_code"])["access_token"]) == "admin"


def password_flow(published: Published, browser: httpx.Client, other: httpx.Client) -> None:
    """A password login by the other client, between two requests of the browser's session."""
    page = browse(browser, "GET", published.device_login(browser)["verification_uri_complete"])
    assert 'name="accept"' in page.text, "the browser is still signed in"
    answer = published.token(other, grant_type="password", username="proxied", password=PASSWORD)
    assert answer.status_code == 200 and user_of(answer.json()["access_token"]) == "proxied", answer.text
    wrong = published.token(other, grant_type="password", username="admin", password="")
    assert wrong.status_code in (400, 401), "no password, no token, whoever signed in before"


def refresh_flow(published: Published, browser: httpx.Client, other: httpx.Client) -> None:
    """Each client's refresh token gives its own user's token, in either order."""
    mine = published.token(other, grant_type="password", username="proxied", password=PASSWORD).json()
    started = published.device_login(browser)
    published.approve(browser, started["verification_uri_complete"], "admin", "")
    theirs = published.poll(browser, started["device_code"])
    for client, tokens, user in ((other, mine, "proxied"), (browser, theirs, "admin"), (other, mine, "proxied")):
        answer = published.token(client, grant_type="refresh_token", refresh_token=tokens["refresh_token"])
        assert answer.status_code == 200 and user_of(answer.json()["access_token"]) == user, answer.text
        tokens["refresh_token"] = answer.json()["refresh_token"]


def logout_flow(published: Published, browser: httpx.Client, other: httpx.Client) -> None:
    """The other client's logout (revoking its refresh token) ends its session only."""
    mine = published.token(other, grant_type="password", username="proxied", password=PASSWORD).json()
    revoked = other.post(f"{published.realm}/protocol/openid-connect/revoke",
                         data={"client_id": "appliance-cli", "token": mine["refresh_token"],
                               "token_type_hint": "refresh_token"})
    assert revoked.status_code == 200, revoked.text
    after = published.token(other, grant_type="refresh_token", refresh_token=mine["refresh_token"])
    assert after.status_code == 400, "revoked"
    page = browse(browser, "GET", published.device_login(browser)["verification_uri_complete"])
    assert 'name="accept"' in page.text, "the browser's session outlives the other client's logout"


FLOWS: dict[str, Callable[[Published, httpx.Client, httpx.Client], None]] = {
    "device and browser login": device_flow, "password": password_flow, "refresh": refresh_flow,
    "logout": logout_flow}


@pytest.mark.parametrize("flow", FLOWS)
def test_a_second_client_gets_nothing_of_the_browser_signed_in_before_it(
        published: Published, browser: httpx.Client, flow: str) -> None:
    with published.client() as other:
        FLOWS[flow](published, browser, other)
    with published.client(keeps_cookies=False) as script:  # the same, from a client that keeps no cookie
        if flow != "device and browser login":  # Keycloak's login pages need their own cookies
            FLOWS[flow](published, browser, script)


def test_only_the_appliances_client_has_login_pages_here(published: Published, realm: Realm) -> None:
    """Keycloak would show its account and admin consoles' login pages (on loopback it starts one);
    here a 400 names client_id, on the authorisation endpoint and on the login page it leads to.
    A body past its route's bound is a 413 before Keycloak sees it."""
    query = ("response_type=code&code_challenge_method=S256&code_challenge=E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM"
             "&redirect_uri={}&client_id={}")  # the consoles need PKCE
    direct = httpx.get(f"{realm.settings.keycloak.realm_url}/protocol/openid-connect/auth?"
                       + query.format(f"{published.realm}/account/", "account-console"), verify=realm.tls, timeout=30)
    assert direct.status_code in (200, 302), "Keycloak itself starts the console's login"
    # Its login form's action, or where it sends the browser: on the public URL, the gateway.
    login_page = form_action(direct, "kc-form-login") if direct.status_code == 200 else direct.headers["location"]
    assert "/login-actions/authenticate?" in login_page and "client_id=account-console" in login_page, login_page
    with published.client(keeps_cookies=False) as client:
        shown = client.get(login_page)
        assert shown.status_code == 400 and shown.json()["error"]["param"] == "client_id", shown.text
        for console in ("account-console", "security-admin-console"):
            answer = client.get(f"{published.realm}/protocol/openid-connect/auth?"
                                + query.format(f"{published.realm}/account/", console))
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "client_id", answer.text
        refused = client.post(f"{published.realm}/protocol/openid-connect/token", data={
            "grant_type": "password", "client_id": "appliance-cli", "username": "proxied", "password": "x" * 1_048_000})
        assert refused.status_code == 413 and refused.json()["error"]["code"] == "request_too_large"


def throttled_records(running: Running) -> list[dict[str, Any]]:
    every = (json.loads(line) for path in log_files(running.appliance.home.audit)
             for line in path.read_bytes().splitlines())
    return [record for record in every if record["action"] == "identity.throttled"]


def test_a_source_guessing_passwords_is_throttled_and_recorded(running: Running, realm: Realm, ca: Path) -> None:
    """30 guesses as fast as they go: the first `login_burst` reach Keycloak, the rest are 429 with
    Retry-After and recorded; the account Keycloak locked is unlocked again by the wait alone."""
    user_id = realm.ensure_user("guessed-remotely", PASSWORD, ["user"])
    with gateway_settings(running, bind="0.0.0.0", public_url=public_url(realm), login_burst=5,
                          login_attempts_per_minute=2):
        published = Published(public_url(realm), ca)
        with published.client(keeps_cookies=False) as client:
            before = len(throttled_records(running))
            answers = [published.token(client, grant_type="password", username="guessed-remotely", password=WRONG)
                       for _ in range(30)]
    statuses = [answer.status_code for answer in answers]
    assert statuses[:5] == [400] * 5 and statuses.count(429) >= 24, statuses
    throttled = next(answer for answer in answers if answer.status_code == 429)
    assert int(throttled.headers["retry-after"]) >= 1 and throttled.json()["error"]["code"] == "login_rate_exceeded"
    mine = throttled_records(running)[before:]
    assert mine and mine[0]["source"] == "127.0.0.1" and mine[0]["status"] == 429, mine
    path = f"admin/realms/{realm.settings.keycloak.realm}/attack-detection/brute-force/users/{user_id}"
    deadline = time.monotonic() + 60
    while realm.admin.connection.raw_get(path).json()["disabled"]:  # temporary: lockout_wait_s
        assert time.monotonic() < deadline, "the lockout did not pass"
        time.sleep(0.5)
