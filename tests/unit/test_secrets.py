"""Secrets: generated once, 0600, stable, refused when others can read them."""

import os
import stat

import pytest

from appliance.errors import StateError
from appliance.home import Home
from appliance.secrets import secret


def test_generated_once_private_and_stable(home: Home) -> None:
    first = secret(home, "engine-api-key")
    assert len(first) >= 40
    path = home.secrets / "engine-api-key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(home.secrets.stat().st_mode) == 0o700
    assert stat.S_IMODE(home.root.stat().st_mode) == 0o700
    assert secret(home, "engine-api-key") == first
    assert secret(home, "other") != first


def test_the_state_dir_stays_private_but_keeps_a_passage_granted_to_a_group(home: Home) -> None:
    """The supervised PostgreSQL's user passes through the state dir and run/ (0710) to its own
    directories; ensure() keeps that, and makes nothing else more open."""
    home.root.chmod(0o710)
    home.run.chmod(0o710)
    home.secrets.chmod(0o710)
    home.ensure()
    assert [stat.S_IMODE(path.stat().st_mode) for path in (home.root, home.run, home.secrets, home.logs)] == [
        0o710, 0o710, 0o700, 0o700]
    home.root.chmod(0o755)
    home.ensure()
    assert stat.S_IMODE(home.root.stat().st_mode) == 0o700  # open to all is no grant: closed again


def test_readable_secret_is_refused(home: Home) -> None:
    secret(home, "s")
    os.chmod(home.secrets / "s", 0o644)
    with pytest.raises(StateError, match="readable by others") as caught:
        secret(home, "s")
    assert caught.value.hint == f"chmod 600 {home.secrets / 's'}"
