"""Keycloak's login pages walked as a person's browser would."""

from __future__ import annotations

import html
import re
import ssl
from typing import Any

import httpx


def approve_device_login(verification_url: str, username: str, password: str, tls: ssl.SSLContext) -> str:
    """Do in Keycloak's pages what a person does in a browser: open the link, sign in, consent."""
    with httpx.Client(timeout=30, verify=tls) as browser:
        page = browse(browser, "GET", verification_url)
        page = browse(browser, "POST", form_action(page, "kc-form-login"),
                      data={"username": username, "password": password, "credentialId": ""})
        if 'name="accept"' in page.text:  # the device grant asks the user to consent
            page = browse(browser, "POST", form_action(page, None), data={"accept": "Yes"})
        return page.text


def browse(browser: httpx.Client, method: str, url: str, **kwargs: Any) -> httpx.Response:
    """Follow redirects like a browser."""
    while True:
        response = browser.request(method, url, **kwargs)
        if response.status_code not in (301, 302, 303, 307) or "location" not in response.headers:
            return response
        url, method, kwargs = str(response.url.join(response.headers["location"])), "GET", {}


def form_action(page: httpx.Response, form_id: str | None) -> str:
    """The absolute action URL of the form with `form_id` (or the first form) in a page."""
    for tag in re.findall(r"<form\b[^>]*>", page.text):
        if form_id is None or f'id="{form_id}"' in tag:
            action = re.search(r'action="([^"]+)"', tag)
            assert action is not None, tag
            return str(page.url.join(html.unescape(action.group(1))))
    raise AssertionError(f"no form {form_id!r} in page: {page.text[:300]}")
