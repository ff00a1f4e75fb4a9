"""Backups of one appliance's state: taken while it serves, checked whole before anything is used,
restored only into a fresh state directory (built beside it and moved into place at the end, so
a refused or failed restore leaves the target as it was).

What a backup holds, as a tar inside an age file (installer.backup_age; backups of earlier
versions in the appliance's own envelope, installer.backup_legacy, are still read), which encrypts
all of it: settings can hold S3 keys and secrets/ every generated secret.
    state/...        the state directory's files: settings, secrets, the CA, the registries of
                     adapters, datasets, task sets, API keys and hosts with their files, the local
                     artifact store; the SQLite queues through SQLite's backup API (a consistent
                     copy while they are written); the audit log up to its last complete record,
                     checkpoints read first, so every checkpoint names a record the copy holds
    keycloak.dump    Keycloak's PostgreSQL database: pg_dump's custom format, one snapshot
    manifest.json    last: each member's size and SHA-256, and what stands for Keycloak
Left out: what is installed from the bundle or made again (run/, logs/, cache/, models/, the
Keycloak install, PostgreSQL's files, for which the dump stands, training checkpoints) and
backups kept in the local artifact store.
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import hashlib
import io
import json
import os
import pwd
import re
import secrets
import shutil
import sqlite3
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Literal

from appliance.durable import fsync_directory
from appliance.errors import Conflict, Invalid, StateError
from appliance.home import Home, public_file
from appliance.settings import Settings, load_settings
from audit.writer import CHECKPOINTS, LOCK, complete_lines
from installer import backup_age, backup_legacy, postgres
from installer.backup_archive import BackupError
from installer.keycloak_migration import h2_open

MANIFEST = "manifest.json"
KEYCLOAK_DUMP = "keycloak.dump"
STATE = "state"
# Rebuilt at `up` or not worth keeping: metrics history (monitoring/) is Prometheus's, kept by its retention.
LEFT_OUT = {("run",), ("logs",), ("cache",), ("models",), ("postgres",), ("monitoring",), ("artifacts", "backups")}
MANIFEST_FORMAT = 1  # the newest manifest this version reads and writes
MAX_MANIFEST = 1 << 26
MAX_EXTENDED_HEADER = 1 << 16  # a PAX or GNU long-name header: tarfile holds it in memory whole
# Modes restored: no set-id or execute bits on files, nothing writable by group, and nothing for
# others but reading the public files (appliance.home.PUBLIC_FILES) and passing through directories
# to them (the directories they are in alone).
FILE_MODES, PUBLIC_FILE_MODES, DIRECTORY_MODES = 0o640, 0o644, 0o750
# The accounts restored files may belong to (by name); anything else is the restoring user's.
SERVICE_ACCOUNTS = ("appliance-train", "appliance-exec", "appliance-db")
LOCK_FILE = "backup.lock"
SQLITE_MAGIC = b"SQLite format 3\x00"
SQLITE_SIDE_FILES = ("-wal", "-shm", "-journal")
KeycloakPart = Literal["postgres", "dev-file", "external", "external-postgres"]


@dataclass
class Manifest:
    """What a backup holds: written last, checked against every member on verify and restore."""

    created: str
    appliance_version: str
    source: str
    keycloak: KeycloakPart
    members: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def files(self) -> int:
        return sum(1 for name, member in self.members.items()
                   if name.startswith(f"{STATE}/") and not member.get("directory"))

    @property
    def size(self) -> int:
        return sum(int(member["size"]) for member in self.members.values())

    def to_json(self) -> bytes:
        return json.dumps({"format": MANIFEST_FORMAT, "created": self.created,
                           "appliance_version": self.appliance_version, "source": self.source,
                           "keycloak": self.keycloak, "members": self.members},
                          sort_keys=True, indent=1).encode()

    @classmethod
    def parse(cls, data: bytes, name: str) -> Manifest:
        try:
            fields = json.loads(data)
            written = int(fields.get("format", 1))
            manifest = cls(str(fields["created"]), str(fields["appliance_version"]), str(fields["source"]),
                           fields["keycloak"], dict(fields["members"]))
            for member in manifest.members.values():
                int(member["size"]), bytes.fromhex(member["sha256"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise BackupError(f"{name}: its manifest is damaged ({type(exc).__name__})") from None
        if written > MANIFEST_FORMAT:
            raise BackupError(f"{name} was written by a newer appliance ({manifest.appliance_version}, manifest "
                              f"format {written}); this one reads formats up to {MANIFEST_FORMAT}",
                              hint="restore it with that version or newer")
        if manifest.keycloak not in ("postgres", "dev-file", "external", "external-postgres"):
            raise BackupError(f"{name}: its manifest names an unknown Keycloak part {manifest.keycloak!r}")
        return manifest


def appliance_version() -> str:
    return version("appliance")


# --- create -------------------------------------------------------------------------------------


def _left_out(relative: PurePosixPath, also: tuple[tuple[str, ...], ...] = ()) -> bool:
    """Whether a path of the state dir (a file or a directory) stays out of backups (and is
    refused in one: what a backup never holds, a crafted one may not plant)."""
    parts = relative.parts
    if (any(parts[:len(prefix)] == prefix for prefix in (*LEFT_OUT, *also)) or "checkpoints" in parts
            or parts[-1].endswith(".partial")):
        return True
    if parts[0] == "keycloak" and len(parts) > 1:  # its install comes from the bundle; of its data, dev-file's
        return not (parts[1:] == ("events-cursor.json",) or parts[1:] == ("data",) or parts[1:3] == ("data", "h2"))
    return parts[-1].endswith(SQLITE_SIDE_FILES) or (parts[0] == "audit" and parts[-1] == LOCK)


def _store_inside(settings: Settings, home: Home) -> tuple[tuple[str, ...], ...]:
    """The backups of a local artifact store kept inside the state dir: never in a backup."""
    if settings.artifacts.store != "local" or not settings.artifacts.path:
        return ()
    store = Path(settings.artifacts.path).resolve()
    if not store.is_relative_to(home.root.resolve()):
        return ()
    return ((*store.relative_to(home.root.resolve()).parts, STORE_PREFIX.strip("/")),)


def _state_paths(home: Home, also: tuple[tuple[str, ...], ...]) -> Iterator[tuple[Path, bool]]:
    """The state directory's directories and regular files that go into a backup, each directory
    before what it holds, and the audit log's checkpoints before its records (see the docstring)."""
    for directory, subdirs, files in os.walk(home.root):
        here = Path(directory)
        relative = PurePosixPath(here.relative_to(home.root).as_posix())
        subdirs[:] = sorted(name for name in subdirs if not _left_out(relative / name, also))
        for name in subdirs:
            if not (here / name).is_symlink():
                yield here / name, True
        ordered = sorted(files, key=lambda name: (here != home.audit or name != CHECKPOINTS, name))
        for name in ordered:
            path = here / name
            if not path.is_symlink() and path.is_file() and not _left_out(relative / name, also):
                yield path, False


def _sqlite_copy(path: Path, into: Path) -> None:
    source = sqlite3.connect(path, timeout=60)
    target = sqlite3.connect(into)
    try:
        with target:
            source.backup(target)
    finally:
        target.close()
        source.close()


def _snapshot(path: Path, home: Home, scratch: Path) -> Path:
    """A consistent copy of a file that may be written while the backup runs (a SQLite database,
    an audit file), in `scratch`; other files as they are."""
    with path.open("rb") as head:
        magic = head.read(len(SQLITE_MAGIC))
    copy = scratch / secrets.token_hex(8)
    if magic == SQLITE_MAGIC:
        _sqlite_copy(path, copy)
    elif path.parent == home.audit and path.suffix == ".jsonl":
        copy.write_bytes(b"".join(line + b"\n" for line in complete_lines(path.read_bytes())))
    else:
        return path
    return copy


class _Adder:
    """Adds members to the tar, hashing each into the manifest."""

    def __init__(self, archive: tarfile.TarFile, manifest: Manifest) -> None:
        self.archive, self.manifest = archive, manifest

    def add(self, name: str, copy: Path, original: Path) -> None:
        """The file `original` (its mode and owner), as read from `copy` (a snapshot, or itself)."""
        digest = hashlib.sha256()
        try:
            with copy.open("rb") as source:
                info = _info(name, original)
                info.size = os.fstat(source.fileno()).st_size
                self.archive.addfile(info, _Hashing(source, digest))
        except OSError as exc:  # e.g. a file cut shorter while it was read: this backup is not whole
            raise StateError(f"cannot copy {original} into the backup ({exc}); take the backup again") from exc
        self.manifest.members[name] = {"size": info.size, "sha256": digest.hexdigest()}

    def add_directory(self, name: str, path: Path) -> None:
        info = _info(name, path)
        info.type = tarfile.DIRTYPE
        self.archive.addfile(info)
        self.manifest.members[name] = {"size": 0, "sha256": "", "directory": True}


def _info(name: str, path: Path) -> tarfile.TarInfo:
    """A member named `name` with the mode and owner of `path`, by name (uids differ between hosts)."""
    status = path.stat()
    info = tarfile.TarInfo(name)
    info.mode, info.mtime = status.st_mode & 0o777, int(status.st_mtime)
    with contextlib.suppress(KeyError):
        info.uname = pwd.getpwuid(status.st_uid).pw_name
    with contextlib.suppress(KeyError):
        info.gname = grp.getgrgid(status.st_gid).gr_name
    return info


class _Hashing(io.RawIOBase):
    def __init__(self, source: BinaryIO, digest: Any) -> None:
        self.source, self.digest = source, digest

    def read(self, size: int = -1) -> bytes:
        data = self.source.read(size)
        self.digest.update(data)
        return data


def _keycloak_part(settings: Settings, home: Home) -> KeycloakPart:
    keycloak = settings.keycloak
    if keycloak.mode == "external":
        return "external"
    if keycloak.external_postgres is not None:
        return "external-postgres"  # the organisation's server, backed up by its own means
    if keycloak.database == "postgres":
        return "postgres"
    if h2_open(home):
        raise Conflict("Keycloak runs on its dev-file database, which cannot be copied while it is open",
                       hint="stop it (appliance down), or move Keycloak to PostgreSQL (keycloak.database = "
                            "\"postgres\"), whose backups are taken while it serves")
    return "dev-file"


@contextlib.contextmanager
def _one_at_a_time(home: Home) -> Iterator[None]:
    """One backup of an appliance at a time (scheduled or not); the scratch copies of one that was
    killed (plain SQLite copies, a database dump) are removed before the next begins."""
    fd = os.open(home.run / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Conflict("another backup of this appliance is being taken", hint="wait for it") from None
        for stale in home.run.glob("backup-*"):
            shutil.rmtree(stale, ignore_errors=True)
        yield
    finally:
        os.close(fd)


def create(settings: Settings, home: Home, out: BinaryIO, passphrase: bytes) -> Manifest:
    """Write a backup of `home` to `out`, sealed with `passphrase` (callers hold _one_at_a_time)."""
    created = datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
    manifest = Manifest(created, appliance_version(), str(home.root), _keycloak_part(settings, home))
    sealed = backup_age.AgeWriter(out, passphrase)
    try:
        _archive(settings, home, sealed, manifest)
    except BaseException:
        sealed.abort()
        raise
    sealed.close()
    return manifest


def _archive(settings: Settings, home: Home, sealed: backup_age.AgeWriter, manifest: Manifest) -> None:
    """The tar of the backup, written to `sealed`, its members hashed into `manifest`."""
    with tempfile.TemporaryDirectory(prefix="backup-", dir=home.run) as scratch, \
            tarfile.open(fileobj=sealed, mode="w|", format=tarfile.PAX_FORMAT) as archive:  # type: ignore[call-overload]
        adder = _Adder(archive, manifest)
        if manifest.keycloak == "postgres":  # first: the snapshot the rest is nearest to
            dump = Path(scratch) / KEYCLOAK_DUMP
            with postgres.reachable(home, settings.keycloak) as environment:
                dumped = subprocess.run([str(postgres.binaries() / "pg_dump"), "--format=custom", f"--file={dump}"],
                                        env=environment, capture_output=True, text=True, check=False)
            if dumped.returncode != 0:
                raise StateError(f"pg_dump of Keycloak's database failed: {dumped.stderr.strip()[-800:]}")
            adder.add(KEYCLOAK_DUMP, dump, dump)
        for path, is_directory in _state_paths(home, _store_inside(settings, home)):
            relative = path.relative_to(home.root).as_posix()
            if is_directory:
                adder.add_directory(f"{STATE}/{relative}", path)
                continue
            try:
                copy = _snapshot(path, home, Path(scratch))
            except FileNotFoundError:
                continue  # removed since it was listed (a finished upload, a rotated temporary file)
            except (OSError, sqlite3.Error) as exc:
                raise StateError(f"cannot copy {path} into the backup: {exc}") from exc
            adder.add(f"{STATE}/{relative}", copy, path)
            if copy != path:
                copy.unlink()
        data = manifest.to_json()
        info = tarfile.TarInfo(MANIFEST)
        info.size, info.mode, info.mtime = len(data), 0o600, int(time.time())
        archive.addfile(info, io.BytesIO(data))


# --- verify and restore -------------------------------------------------------------------------


def _member_path(name: str, backup: str) -> PurePosixPath | None:
    """Where a `state/` member goes, relative to the state dir; None for the other known members.
    Anything else (absolute, `..`, empty or odd parts) is refused: a backup is hostile until read."""
    if name in (MANIFEST, KEYCLOAK_DUMP):
        return None
    path = PurePosixPath(name)
    parts = path.parts
    if (len(parts) < 2 or parts[0] != STATE or path.is_absolute() or name != path.as_posix()
            or any(part in ("", ".", "..") or "\x00" in part or "\\" in part for part in parts)):
        raise BackupError(f"{backup}: member {name!r} is not a path this appliance writes")
    return PurePosixPath(*parts[1:])


def read_backup(source: BinaryIO, passphrase: bytes, name: str, into: Path | None) -> Manifest:
    """Read the whole backup, checking every member against the manifest; with `into`, write the
    state files under it (and the Keycloak dump as into/KEYCLOAK_DUMP). BackupError if anything
    does not check out; then what was written under `into` is the caller's to remove."""
    reader = opened(source, passphrase, name)
    try:
        return _read_archive(reader, name, into)
    except BackupError:
        reader.close()  # the envelope's refusal, where it has one, says why the archive read short
        raise
    except BaseException:
        with contextlib.suppress(BackupError):
            reader.close()
        raise


def opened(source: BinaryIO, passphrase: bytes, name: str) -> backup_age.AgeReader | backup_legacy.SealedReader:
    """A reader of the backup's archive: an age file, or the envelope of earlier versions."""
    head = source.read(len(backup_age.MAGIC))
    stream = io.BufferedReader(_Prefixed(head, source))
    if head == backup_age.MAGIC:
        return backup_age.AgeReader(stream, passphrase, name)
    if head.startswith(backup_legacy.MAGIC):
        return backup_legacy.SealedReader(stream, passphrase, name)
    raise BackupError(f"{name} is not an appliance backup (it is not an age file)")


class _Prefixed(io.RawIOBase):
    """`head`, then the rest of `source`: the bytes read to tell the format, given back."""

    def __init__(self, head: bytes, source: BinaryIO) -> None:
        self.head, self.source = head, source

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self.head[:len(buffer)] if self.head else self.source.read(len(buffer))
        self.head = self.head[len(data):]
        buffer[:len(data)] = data
        return len(data)


def _read_archive(reader: backup_age.AgeReader | backup_legacy.SealedReader, name: str,
                  into: Path | None) -> Manifest:
    seen: dict[str, dict[str, Any]] = {}
    files: set[PurePosixPath] = set()
    directories: set[PurePosixPath] = set()
    manifest_data: bytes | None = None
    try:
        with tarfile.open(fileobj=reader, mode="r|", tarinfo=_BoundedInfo) as archive:  # type: ignore[call-overload]
            for member in archive:
                if member.name in seen or (manifest_data is not None):
                    raise BackupError(f"{name}: member {member.name!r} is repeated or follows the manifest")
                relative = _member_path(member.name, name)
                if relative is not None:
                    if _left_out(relative):
                        raise BackupError(f"{name}: member {member.name!r} is a path a backup never holds")
                    if relative in files or any(parent in files for parent in relative.parents) or (
                            not member.isdir() and relative in directories):
                        raise BackupError(f"{name}: its members collide at {member.name!r}")
                    (directories if member.isdir() else files).add(relative)
                    directories.update(relative.parents)
                if member.isdir() and relative is not None:
                    if into is not None:
                        _make_directory(into / STATE / relative, member)
                    seen[member.name] = {"size": 0, "sha256": "", "directory": True}
                    continue
                if member.type not in (tarfile.REGTYPE, tarfile.AREGTYPE) or member.issparse():
                    raise BackupError(f"{name}: member {member.name!r} is neither a regular file nor a directory")
                if member.name == MANIFEST and member.size > MAX_MANIFEST:
                    raise BackupError(f"{name}: its manifest is {member.size} bytes; the file is damaged")
                extracted = archive.extractfile(member)
                assert extracted is not None  # a regular file
                if member.name == MANIFEST:
                    manifest_data = extracted.read()
                    continue
                target = None
                if into is not None:
                    target = into / KEYCLOAK_DUMP if relative is None else into / STATE / relative
                seen[member.name] = _extract(extracted, member, target, name)
    except tarfile.TarError as exc:
        raise BackupError(f"{name}: its archive is damaged ({exc})") from None
    reader.finish()  # the rest, to its authenticated end
    if manifest_data is None:
        raise BackupError(f"{name} has no manifest: it is cut short or not a backup of this appliance")
    manifest = Manifest.parse(manifest_data, name)
    listed = {member: (info["size"], info["sha256"], bool(info.get("directory")))
              for member, info in manifest.members.items()}
    found = {member: (info["size"], info["sha256"], bool(info.get("directory"))) for member, info in seen.items()}
    if listed != found:
        differ = sorted(set(listed.items()) ^ set(found.items()))
        raise BackupError(f"{name}: {len(differ)} member(s) differ from its manifest, first {differ[0][0]!r}")
    if (manifest.keycloak == "postgres") != (KEYCLOAK_DUMP in seen):
        raise BackupError(f"{name}: its manifest and its Keycloak dump disagree")
    return manifest


class _BoundedInfo(tarfile.TarInfo):
    """Refuses an extended header (PAX, GNU long name) larger than a path needs before tarfile
    reads it whole into memory."""

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        extended = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)
        if self.type in extended and self.size > MAX_EXTENDED_HEADER:
            raise BackupError(f"an extended tar header of {self.size} bytes; the backup is damaged or crafted")
        return super()._proc_member(tarfile_)  # type: ignore[misc, no-any-return]


def _extract(source: BinaryIO, member: tarfile.TarInfo, target: Path | None, backup: str) -> dict[str, Any]:
    digest, size = hashlib.sha256(), 0
    out = None
    if target is not None:
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        out = os.fdopen(fd, "wb")
    with out or contextlib.nullcontext():
        while chunk := source.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
            if out is not None:
                out.write(chunk)
        if out is not None:
            os.fchmod(out.fileno(), restored_mode(member))
            _chown(out.fileno(), member)
    if size != member.size:
        raise BackupError(f"{backup}: member {member.name!r} is cut short")
    return {"size": size, "sha256": digest.hexdigest()}


def restored_mode(member: tarfile.TarInfo) -> int:
    """The mode a restored file gets: its own, less what FILE_MODES (or, for a public file,
    PUBLIC_FILE_MODES) leaves out; Keycloak's dump 0600."""
    if member.name == KEYCLOAK_DUMP:
        return 0o600
    public = public_file(member.name.removeprefix(f"{STATE}/"))
    return member.mode & (PUBLIC_FILE_MODES if public else FILE_MODES)


def _make_directory(path: Path, member: tarfile.TarInfo) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchmod(fd, member.mode & DIRECTORY_MODES)
        _chown(fd, member)
    finally:
        os.close(fd)


def _chown(fd: int, member: tarfile.TarInfo) -> None:
    """The service account the file belonged to (by name), where it exists here; any other owner
    named in a backup (which may be crafted) is not given files: they stay the restoring user's."""
    if os.geteuid() != 0:
        return
    uid = gid = -1
    with contextlib.suppress(KeyError):
        uid = pwd.getpwnam(member.uname).pw_uid if member.uname in SERVICE_ACCOUNTS else -1
    with contextlib.suppress(KeyError):
        gid = grp.getgrnam(member.gname).gr_gid if member.gname in SERVICE_ACCOUNTS else -1
    os.fchown(fd, uid, gid)


def fresh_target(root: Path) -> None:
    """Refuse a state directory that holds anything but empty directories (a restore never merges)."""
    if root.is_symlink():
        raise Conflict(f"{root} is a symbolic link", hint="name the state directory itself")
    if not root.exists():
        return
    if not root.is_dir():
        raise Conflict(f"{root} is not a directory")
    for directory, _, files in os.walk(root):
        if files:
            raise Conflict(f"{root} is not a fresh state directory (it holds {Path(directory) / files[0]})",
                           hint="restore into an empty or new APPLIANCE_HOME; this one was left as it was")


def restore(source: BinaryIO, passphrase: bytes, name: str, root: Path) -> Manifest:
    """Restore the backup into the fresh state directory `root`, built beside it first."""
    fresh_target(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{root.name}.restoring-", dir=root.parent))  # 0700
    try:
        (building / STATE).mkdir(mode=0o700)
        manifest = read_backup(source, passphrase, name, building)
        staged = Home(building / STATE).ensure()
        if manifest.keycloak == "postgres" and load_settings(staged.settings_file).keycloak.external_postgres is None:
            # Only now, every file in place behind the state dir's 0700/0710: PostgreSQL's user
            # passes through to its new cluster (the state dir lets only its group on).
            building.chmod(0o711)
            _restore_keycloak(staged, building / KEYCLOAK_DUMP)
        fresh_target(root)  # still: nothing else wrote there meanwhile
        if root.exists():
            shutil.rmtree(root)  # only empty directories (checked)
        staged.root.rename(root)
        fsync_directory(root.parent)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return manifest


def _restore_keycloak(staged: Home, dump: Path) -> None:
    """Keycloak's database into a new cluster of the supervised server."""
    settings = load_settings(staged.settings_file)
    with postgres.reachable(staged, settings.keycloak) as environment:
        # As Keycloak's ordinary role, which owns what it makes (older backups hold database `postgres`).
        restored = subprocess.run([str(postgres.binaries() / "pg_restore"), "--exit-on-error", "--no-password",
                                   "--no-owner", "--no-acl", f"--dbname={postgres.KEYCLOAK_DATABASE}", str(dump)],
                                  env=environment, capture_output=True, text=True, check=False)
    if restored.returncode != 0:
        raise StateError(f"pg_restore of Keycloak's database failed: {restored.stderr.strip()[-800:]}")


# --- files and the artifact store ---------------------------------------------------------------

STORE_PREFIX = "backups/"


def create_file(settings: Settings, home: Home, path: Path, passphrase: bytes) -> Manifest:
    """A backup written to `path` (0600), which must not exist: written beside it, then moved in."""
    if path.parent.resolve().is_relative_to(home.root.resolve()):
        raise Invalid(f"{path} is inside the state directory {home.root}: the next backup would hold it, and it "
                      "would be lost with the host", hint="write backups elsewhere, or use --to-store")
    with _one_at_a_time(home):
        return _write_file(settings, home, path, passphrase)


def _write_file(settings: Settings, home: Home, path: Path, passphrase: bytes) -> Manifest:
    if path.exists() or path.is_symlink():
        raise Conflict(f"{path} exists", hint="choose a new file name; a backup never overwrites one")
    partial = path.with_name(f".{path.name}.{secrets.token_hex(4)}.partial")
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise StateError(f"cannot write {path}: {exc.strerror}") from exc
    try:
        with os.fdopen(fd, "wb") as out:
            manifest = create(settings, home, out, passphrase)
            out.flush()
            os.fsync(out.fileno())
        os.link(partial, path)  # fails, rather than replaces, if a file appeared meanwhile
        fsync_directory(path.parent)
    finally:
        partial.unlink(missing_ok=True)
    return manifest


STORE_NAME = re.compile(r"appliance-\d{8}T\d{6}Z-\d{6}-[0-9a-f]{6}\.backup")  # time, its microseconds, chance


def store_prefix(home: Home) -> str:
    """This appliance's folder of backups in the artifact store (several may share one store): named
    by its CA, which a restore keeps, so a restored appliance goes on with the same series."""
    from appliance.tls import certificate_sha256, ensure_ca

    return f"{STORE_PREFIX}{certificate_sha256(ensure_ca(home)[0])[:16]}/"


def create_in_store(settings: Settings, home: Home, passphrase: bytes, keep: int | None = None) -> tuple[str, Manifest]:
    """A backup put in the artifact store (in this appliance's folder under backups/); with `keep`,
    older ones of this appliance beyond the newest `keep` are removed afterwards. Returns its key."""
    from appliance.artifacts import artifact_store

    store = artifact_store(settings.artifacts, home)
    with _one_at_a_time(home), tempfile.TemporaryDirectory(prefix="backup-", dir=home.run) as scratch:
        path = Path(scratch) / "backup"
        manifest = _write_file(settings, home, path, passphrase)
        now = datetime.now(UTC)
        key = f"{store_prefix(home)}appliance-{now:%Y%m%dT%H%M%SZ-%f}-{secrets.token_hex(3)}.backup"
        with path.open("rb") as data:
            store.put(key, data, retain_days=0)
    if keep is not None:
        for old in stored(settings, home)[:-keep]:
            store.delete(old)
    return key, manifest


def stored(settings: Settings, home: Home) -> list[str]:
    """Keys of this appliance's backups in the artifact store, oldest first (their names sort by
    time); other objects there (an operator's own copies) are neither listed nor removed."""
    from appliance.artifacts import artifact_store

    keys = artifact_store(settings.artifacts, home).keys(store_prefix(home))
    return [key for key in keys if STORE_NAME.fullmatch(key.rsplit("/", 1)[-1])]
