"""`appliance backup ...`: take a backup while the appliance serves, check one, restore one into a
fresh state directory, list those in the artifact store."""

from __future__ import annotations

import getpass
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, BinaryIO

import typer
from rich.console import Console

from appliance.changes import Change, Target, announce, note_target, records_change
from appliance.commands.common import AsJson, context, print_json
from appliance.errors import Invalid
from appliance.home import BACKUP_PASSPHRASE_ENV, Home

if TYPE_CHECKING:
    from installer.backup import Manifest

backup_app = typer.Typer(help="Backups of the state: create while serving, verify, restore into a fresh state "
                         "directory, list those in the artifact store.", no_args_is_help=True)
out = Console()

KeyFile = Annotated[Path | None, typer.Option(
    "--key-file", help="A file (0600) that seals the backup: a passphrase (one line) or an age identity made by "
    "`age-keygen -o FILE`. Without it: APPLIANCE_BACKUP_PASSPHRASE, else a passphrase on standard input (asked "
    "twice at a terminal when creating).")]


def passphrase(key_file: Path | None, *, confirm: bool) -> bytes:
    """The backup's passphrase, from the key file, the environment or standard input; never argv."""
    from installer.backup_archive import check_passphrase, passphrase_from

    if key_file is None and BACKUP_PASSPHRASE_ENV not in os.environ and sys.stdin.isatty():
        first = getpass.getpass("backup passphrase: ")
        if confirm and getpass.getpass("again: ") != first:
            raise Invalid("the two passphrases differ")
        return check_passphrase(first.encode(), "the terminal")
    try:
        return passphrase_from(key_file, sys.stdin.buffer)
    finally:
        os.environ.pop(BACKUP_PASSPHRASE_ENV, None)  # read: no child process of ours inherits it


def _summary(manifest: Manifest, started: float) -> str:
    part = {"postgres": "Keycloak's PostgreSQL database", "dev-file": "Keycloak's dev-file database",
            "external": "no Keycloak database (external Keycloak)"}[manifest.keycloak]
    return (f"{manifest.files} files, {manifest.size / (1 << 20):.1f} MiB before sealing, with {part}, "
            f"in {time.monotonic() - started:.1f} s")


@backup_app.command("create")
@records_change("backup.create")
def create_command(
    out_file: Annotated[Path | None, typer.Option("--out", help="The backup file to write (must not exist).")] = None,
    to_store: Annotated[bool, typer.Option("--to-store", help="Put it in the artifact store, under backups/.")]
    = False,
    key_file: KeyFile = None,
) -> None:
    """Back up the state while the appliance serves: Keycloak's database, the queues, settings, the
    audit log, the registries with their files, and the secrets, all sealed with a passphrase."""
    from installer import backup

    if (out_file is None) == (not to_store):
        raise Invalid("name where the backup goes: --out FILE or --to-store (one of them)")
    settings, home = context()
    sealing = passphrase(key_file, confirm=True)
    started = time.monotonic()
    if out_file is not None:
        note_target("backup", str(out_file))
        manifest = backup.create_file(settings, home, out_file, sealing)
        where = str(out_file)
    else:
        where, manifest = backup.create_in_store(settings, home, sealing)
        note_target("backup", where)
    out.print(f"backup {where}: {_summary(manifest, started)}",
              markup=False, soft_wrap=True)


@backup_app.command("verify")
def verify_command(
    file: Annotated[Path, typer.Argument(help="The backup file.")],
    key_file: KeyFile = None,
) -> None:
    """Read the whole backup with its passphrase: every chunk authenticated, every file against its manifest."""
    from installer.backup import read_backup

    sealing = passphrase(key_file, confirm=False)
    started = time.monotonic()
    with _open(file) as source:
        manifest = read_backup(source, sealing, str(file), None)
    out.print(f"{file}: a backup of {manifest.source} taken {manifest.created} by appliance "
              f"{manifest.appliance_version}, intact: "
              f"{_summary(manifest, started)}",
              markup=False, soft_wrap=True)


@backup_app.command("restore")
def restore_command(
    file: Annotated[Path, typer.Argument(help="The backup file.")],
    key_file: KeyFile = None,
) -> None:
    """Restore a backup into a fresh state directory (APPLIANCE_HOME, empty or new); a backup that
    does not check out whole is refused, and the directory is left as it was."""
    from installer.backup import restore

    root = Home.from_env().root
    sealing = passphrase(key_file, confirm=False)
    started = time.monotonic()
    with _open(file) as source:
        manifest = restore(source, sealing, str(file), root)
    detail = f"restored from {file}, taken {manifest.created} of {manifest.source} by {manifest.appliance_version}"
    announce(Change("backup.restore", "allowed", 0, Target(kind="backup", name=str(file)), detail))
    out.print(f"restored {file} into {root}: "
              f"{_summary(manifest, started)}\n"
              "next: `appliance keycloak install` if Keycloak is not installed here, then `appliance up`",
              markup=False, soft_wrap=True)


@backup_app.command("list")
def list_command(json: AsJson = False) -> None:
    """The backups in the artifact store, oldest first."""
    from installer.backup import stored

    settings, home = context()
    keys = stored(settings, home)
    if json:
        print_json({"store": settings.artifacts.store, "backups": keys})
        return
    out.print("\n".join(keys) if keys else "no backups in the artifact store", markup=False)


def _open(file: Path) -> BinaryIO:
    try:
        return file.open("rb")
    except OSError as exc:
        raise Invalid(f"cannot read {file}: {exc.strerror}") from exc
