"""Health probes of supervised programs over HTTP (httpx's errors end here: a program that does
not answer is simply not healthy yet)."""

from __future__ import annotations

import httpx

from appliance.alerts import MONITORING_USER
from appliance.home import Home
from appliance.local_gateway import health_transport
from appliance.programs import Program
from appliance.secrets import secret
from appliance.unix_http import unix_transport


def client(home: Home) -> httpx.Client:
    """For health URLs: plain HTTP, or HTTPS from a server the appliance's own CA certified."""
    return httpx.Client(timeout=2.0, transport=health_transport(home))


def answers(client: httpx.Client, program: Program, home: Home) -> bool:
    """Whether the program's health URL answers 200 (over its Unix socket, if it has one; with its
    password, if it asks for one)."""
    if program.health_url is None:
        return True
    auth = (MONITORING_USER, secret(home, program.health_password_secret)) if program.health_password_secret else None
    try:
        if program.socket is not None:
            with httpx.Client(transport=unix_transport(program.socket), timeout=client.timeout) as uds:
                return uds.get(program.health_url).status_code == 200
        return client.get(program.health_url, auth=auth).status_code == 200
    except httpx.HTTPError:
        return False
