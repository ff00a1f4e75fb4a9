"""A module of the project as of an earlier commit, importable beside today's under another name:
the baseline a bench measures the current code against, in the same process and run."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

PROJECT = Path(__file__).resolve().parent.parent


def module_at(commit: str, path: str, name: str) -> ModuleType:
    """`path` (e.g. appliance/batches.py) as of `commit`, imported as `name`."""
    source = subprocess.run(["git", "show", f"{commit}:{path}"], capture_output=True, check=True,
                            cwd=PROJECT).stdout
    copy = Path(tempfile.mkdtemp()) / f"{name}.py"
    copy.write_bytes(source)
    spec = importlib.util.spec_from_file_location(name, copy)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module
