"""What the core's commands share: this host's settings and state directory, the gateway's admin
API, a password from standard input."""

from __future__ import annotations

import sys
from typing import Any

from appliance.admin_client import AdminClient
from appliance.errors import ApplianceError
from appliance.home import Home
from appliance.settings import Settings, load_settings


def context() -> tuple[Settings, Home]:
    """This host's settings and its state directory (created if missing)."""
    home = Home.from_env().ensure()
    return load_settings(home.settings_file), home


def admin_api(method: str, path: str, **kwargs: Any) -> Any:
    """One call of the gateway's admin API with the cached administrator token; its JSON answer."""
    settings, home = context()
    return AdminClient(settings, home).call_sync(method, path, **kwargs)


def read_password() -> str:
    """The first line of standard input (--password-stdin)."""
    password = sys.stdin.readline().rstrip("\n")
    if not password:
        raise ApplianceError("--password-stdin: no password on standard input")
    return password
