"""Checks of a real appliance's state directory as the database's system user sees it: what that
user can open in it (it may pass through the root and run/ to its own directories), and the modes
of the files that hold the appliance's secrets."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
from pathlib import Path

from appliance.home import Home, public_file
from installer.postgres import as_db_user

SYSTEM_PYTHON = "/usr/bin/python3"  # the virtual environment's base interpreter may be out of that user's reach
# Run as the database's user: of the paths given (every one under the state dir, named by root: that
# user cannot list the root), those it can list or read and does not own.
_PROBE = """
import json, os, sys
found = []
for path in json.load(sys.stdin):
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            with open(path, "rb", buffering=0) as handle:
                handle.read(1)
    except OSError:
        continue
    try:
        if os.lstat(path).st_uid != os.getuid():
            found.append(path)
    except OSError:
        continue
print(json.dumps(found))
"""


def readable_by_db_user(home: Home) -> list[str]:
    """What the database's user lists or reads in the state directory that is not its own."""
    paths = [str(home.root)]
    for directory, subdirs, files in os.walk(home.root):
        paths += [os.path.join(directory, name) for name in subdirs]
        for name in files:
            path = os.path.join(directory, name)
            with contextlib.suppress(OSError):  # a file gone meanwhile; a pipe or socket is never opened
                if stat.S_ISREG(os.lstat(path).st_mode):
                    paths.append(path)
    done = subprocess.run(as_db_user([SYSTEM_PYTHON, "-I", "-c", _PROBE]), input=json.dumps(paths),
                          capture_output=True, text=True, check=True)
    return list(json.loads(done.stdout))


def db_user_reads(path: Path) -> bool:
    """Whether the database's user can read `path` (cat, as that user)."""
    return subprocess.run(as_db_user(["cat", str(path)]), capture_output=True, check=False).returncode == 0


def private_files_not_private(home: Home) -> dict[str, str]:
    """Files holding the appliance's secrets or private records (settings, secrets/, SQLite
    databases, the registries at the root) that are not 0600 or 0640; public ones excepted."""
    candidates = [home.settings_file, *home.secrets.iterdir(), *home.root.glob("*.json"),
                  *home.root.rglob("*.sqlite")]
    wrong = {}
    for path in candidates:
        relative = path.relative_to(home.root).as_posix()
        if path.is_file() and not public_file(relative):
            mode = stat.S_IMODE(path.stat().st_mode)
            if mode not in (0o600, 0o640):
                wrong[relative] = oct(mode)
    return wrong


def passages_closed(home: Home) -> dict[str, str]:
    """Entries of the root and run/ that give others any right (the database's user would have it)."""
    return {str(entry): oct(stat.S_IMODE(entry.lstat().st_mode)) for directory in (home.root, home.run)
            for entry in directory.iterdir()
            if not entry.is_symlink() and stat.S_IMODE(entry.lstat().st_mode) & 0o007}
