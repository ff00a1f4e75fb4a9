"""Each package's public surface is what its __init__ names, and nothing is missing from it."""

import importlib

import pytest


@pytest.mark.parametrize("package", ["appliance", "serve", "installer"])
def test_all_names_resolve(package: str) -> None:
    module = importlib.import_module(package)
    for name in module.__all__:
        assert hasattr(module, name), f"{package}.{name}"
