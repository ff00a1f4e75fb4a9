"""Generated secrets: created on first use, stored 0600, never logged."""

from __future__ import annotations

import os
import secrets
import stat
from typing import TYPE_CHECKING

from appliance.errors import ApplianceError, StateError
from appliance.home import Home

if TYPE_CHECKING:  # building the settings' schemas is most of what `appliance status` would import
    from pathlib import Path

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


def read_private_file(path: Path, what: str, error: type[ApplianceError] = StateError) -> bytes:
    """The first 4 KiB of a secret an operator keeps in a file (`what` names it in errors, raised as
    `error`): a regular file (no link followed, no FIFO waited on) of this user's, private to them."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror}") from exc
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise error(f"{what} {path} is not a regular file")
        if status.st_uid != os.geteuid() or status.st_mode & 0o077:
            raise error(f"{what} {path} is readable by others or not this user's (mode "
                        f"{status.st_mode & 0o777:o}, uid {status.st_uid})", hint=f"chmod 600 {path}")
        return os.read(fd, 4096)
    finally:
        os.close(fd)
