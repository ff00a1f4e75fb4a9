"""How the appliance's own processes (the CLI, TUI, batch worker, RL loop, health checks) reach the
gateway on this host: over loopback (or its specific bind address), and over HTTPS when the gateway
serves it, verified against the appliance's CA for the name `localhost`, which every certificate the
CA issues holds, whatever certificate the gateway shows the network (appliance.tls)."""

from __future__ import annotations

import ipaddress
from typing import Any

import httpx

from appliance.home import Home
from appliance.settings import Settings
from appliance.tls import LOOPBACK_NAME, ca_file, local_trust


def gateway_url(settings: Settings) -> str:
    """Where this host reaches its gateway (loopback when it listens on every address)."""
    gateway = settings.gateway
    host = gateway.bind
    try:
        address = ipaddress.ip_address(host)
        host = "127.0.0.1" if address.is_unspecified else f"[{host}]" if address.version == 6 else host
    except ValueError:
        pass
    return f"{'https' if gateway.https else 'http'}://{host}:{gateway.port}"


class _AskForLoopback(httpx.HTTPTransport):
    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.extensions["sni_hostname"] = LOOPBACK_NAME
        return super().handle_request(request)


class _AsyncAskForLoopback(httpx.AsyncHTTPTransport):
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        request.extensions["sni_hostname"] = LOOPBACK_NAME
        return await super().handle_async_request(request)


def client_options(settings: Settings, home: Home) -> dict[str, Any]:
    """httpx.Client's base_url and transport for the gateway."""
    if not settings.gateway.https:
        return {"base_url": gateway_url(settings)}
    return {"base_url": gateway_url(settings), "transport": _AskForLoopback(verify=local_trust(home))}


def async_client_options(settings: Settings, home: Home) -> dict[str, Any]:
    """httpx.AsyncClient's base_url and transport for the gateway."""
    if not settings.gateway.https:
        return {"base_url": gateway_url(settings)}
    return {"base_url": gateway_url(settings), "transport": _AsyncAskForLoopback(verify=local_trust(home))}


def health_transport(home: Home) -> httpx.HTTPTransport:
    """For the health URLs of the appliance's servers: those on HTTPS verified as `localhost`."""
    return _AskForLoopback(verify=local_trust(home)) if ca_file(home).is_file() else httpx.HTTPTransport()
