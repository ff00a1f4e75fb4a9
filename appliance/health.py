"""Health probes of supervised programs over HTTP (httpx's errors end here: a program that does
not answer is simply not healthy yet)."""

from __future__ import annotations

import ssl

import httpx

from appliance.home import Home
from appliance.programs import Program
from appliance.tls import ca_file


def client(home: Home) -> httpx.Client:
    """For health URLs: plain HTTP, or HTTPS from a server the appliance's own CA certified."""
    ca = ca_file(home)
    return httpx.Client(timeout=2.0, verify=ssl.create_default_context(cafile=ca) if ca.is_file() else True)


def answers(client: httpx.Client, program: Program) -> bool:
    """Whether the program's health URL answers 200 (over its Unix socket, if it has one)."""
    if program.health_url is None:
        return True
    try:
        if program.socket is not None:
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(program.socket)), timeout=client.timeout) as uds:
                return uds.get(program.health_url).status_code == 200
        return client.get(program.health_url).status_code == 200
    except httpx.HTTPError:
        return False
