"""A package's public names, imported when first used (PEP 562): `import appliance.home` must not
build the settings' schemas, and an engine rank must not load the gateway, yet each package still
names its public face in `__all__`."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_exports(package: str, homes: Mapping[str, str]) -> Callable[[str], object]:
    """The package's `__getattr__`: each public name from the module `homes` gives for it."""

    def __getattr__(name: str) -> object:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(homes[name]), name)

    return __getattr__
