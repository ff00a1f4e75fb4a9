"""Fixtures shared by unit tests: a state directory and a local artifact store of their own."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.artifacts import LocalStore
from appliance.home import Home


@pytest.fixture
def home(tmp_path: Path) -> Home:
    return Home(tmp_path / "h").ensure()


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")
