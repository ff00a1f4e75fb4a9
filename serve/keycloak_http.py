"""The gateway's HTTP clients of Keycloak: its certificate verified as the appliance trusts it, and
a cookie jar that keeps nothing.

httpx keeps every Set-Cookie a response carries in its client's jar and adds those cookies to later
requests that send none of their own. A client shared by callers (the published login endpoints,
the realm's keys, introspection, the event poller) would so hand one caller's Keycloak session to
the next: a browser login's SSO cookies to an anonymous client's device login.
"""

from __future__ import annotations

import ssl
from http.cookiejar import CookieJar, DefaultCookiePolicy

import httpx

TIMEOUT_S = 10.0


def no_cookies() -> CookieJar:
    """A jar whose policy accepts no cookie from any domain: it stays empty, so nothing is sent."""
    return CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))


def keycloak_client(verify: ssl.SSLContext | bool, connect_s: float, *,
                    transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    """A client of Keycloak that carries no state from one request to the next but its connections."""
    return httpx.AsyncClient(timeout=httpx.Timeout(TIMEOUT_S, connect=connect_s), verify=verify,
                             cookies=no_cookies(), transport=transport)
