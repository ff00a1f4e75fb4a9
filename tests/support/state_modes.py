"""Checks of a real appliance's state directory as the database's system user sees it: what that
user can open in it (it may pass through the root and run/ to its own directories), and the modes
of every file and directory in it."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
from pathlib import Path

from appliance.home import Home, public_file
from installer.keycloak_dist import install_dir
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


def modes_not_private(home: Home) -> dict[str, str]:
    """Files and directories anywhere in the state directory that give others any right or let
    their group write (anything but 0600/0640, 0700/0710/0750), public files and Keycloak's
    installed distribution (programs, anyone's to read) excepted."""
    programs = install_dir(home)
    wrong = {}
    for directory, subdirs, files in os.walk(home.root):
        subdirs[:] = [name for name in subdirs if Path(directory, name) != programs]
        for name in [*subdirs, *files]:
            path = Path(directory, name)
            relative = path.relative_to(home.root).as_posix()
            with contextlib.suppress(FileNotFoundError):  # made and gone meanwhile (a temporary file)
                status = path.lstat()
                kind = stat.S_ISDIR(status.st_mode) or stat.S_ISREG(status.st_mode) and not public_file(relative)
                if kind and stat.S_IMODE(status.st_mode) & 0o027:
                    wrong[relative] = oct(stat.S_IMODE(status.st_mode))
    return wrong


def passages_closed(home: Home) -> dict[str, str]:
    """Entries of the root and run/ that give others any right (the database's user would have it)."""
    return {str(entry): oct(stat.S_IMODE(entry.lstat().st_mode)) for directory in (home.root, home.run)
            for entry in directory.iterdir()
            if not entry.is_symlink() and stat.S_IMODE(entry.lstat().st_mode) & 0o007}
