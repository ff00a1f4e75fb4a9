"""Generated secrets: created on first use, stored 0600, never logged."""

from __future__ import annotations

import os
import secrets
import stat
from typing import TYPE_CHECKING

from appliance.errors import StateError
from appliance.home import Home

if TYPE_CHECKING:  # building the settings' schemas is most of what `appliance status` would import
    from appliance.settings import Settings


def secret(home: Home, name: str) -> str:
    """Return the secret called `name`, generating it (mode 0600) if it does not exist yet."""
    path = home.secrets / name
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise StateError(
                f"secret {path} is readable by others (mode {mode:o})",
                hint=f"chmod 600 {path}",
            ) from None
        value = path.read_text().strip()
        if not value:
            raise StateError(f"secret {path} is empty", hint="delete it to have a new one generated") from None
        return value
    except OSError as exc:
        raise StateError(f"cannot create secret {path}: {exc.strerror}") from exc
    value = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as out:
        out.write(value + "\n")
        out.flush()
        os.fsync(out.fileno())
    return value


GATEWAY_CLIENT_SECRET = "gateway-client-secret"


def gateway_client_secret(settings: Settings, home: Home) -> str:
    """The gateway client's secret: from settings (external Keycloak) or generated (embedded)."""
    return settings.keycloak.gateway_client_secret or secret(home, GATEWAY_CLIENT_SECRET)


RL_CLIENT_SECRET = "rl-client-secret"


def rl_client_secret(home: Home) -> str:
    """The RL loop's service identity (client `rl.client_id`): its secret, generated on first use."""
    return secret(home, RL_CLIENT_SECRET)
