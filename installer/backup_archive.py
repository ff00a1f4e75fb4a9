"""What every backup envelope shares: the error a bad backup raises, and where the backup key comes
from and what it may be (a passphrase, or an age X25519 identity made by `age-keygen`). The
envelopes: installer.backup_age (what backups are written in) and installer.backup_legacy (the
appliance's own envelope of earlier versions, read only)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

from appliance.errors import Invalid
from appliance.home import BACKUP_PASSPHRASE_ENV
from appliance.secrets import read_private_file

MIN_PASSPHRASE = 12
IDENTITY_PREFIX = b"AGE-SECRET-KEY-1"


class BackupError(Invalid):
    """A backup file that cannot be used: not one, damaged, cut short, or sealed with another key."""

    code = "bad_backup"


def _identity_line(key: bytes) -> bytes | None:
    """The AGE-SECRET-KEY line of an identity file as `age-keygen` writes it (comment lines starting
    with #, then the key), or None when the key is not one."""
    lines = [line.strip() for line in key.splitlines() if line.strip() and not line.startswith(b"#")]
    if len(lines) == 1 and lines[0].upper().startswith(IDENTITY_PREFIX):
        return lines[0].upper()
    return None


def check_passphrase(passphrase: bytes, source: str) -> bytes:
    """The key's bytes: an age identity's AGE-SECRET-KEY line, or the passphrase without its line end
    (the one rule for every source, so a key file piped to standard input opens what it sealed),
    refused naming where it came from when it is more than one line or too short to guard secrets."""
    if (identity := _identity_line(passphrase)) is not None:
        return identity
    passphrase = passphrase.removesuffix(b"\n").removesuffix(b"\r")
    if b"\n" in passphrase:
        raise Invalid(f"the backup passphrase from {source} is more than one line",
                      hint="a key file holds one line, or an identity made by `age-keygen -o FILE`")
    if len(passphrase) < MIN_PASSPHRASE:
        raise Invalid(f"the backup passphrase from {source} is {len(passphrase)} bytes: it needs at least "
                      f"{MIN_PASSPHRASE}", hint="a key file made with `age-keygen -o FILE` or "
                      "`head -c 32 /dev/urandom | base64 > FILE` serves scheduled backups")
    return passphrase


def passphrase_from(key_file: Path | None, stdin: BinaryIO, environ: Mapping[str, str] = os.environ) -> bytes:
    """The backup key: a key file's contents (private to its owner), else
    APPLIANCE_BACKUP_PASSPHRASE, else standard input's first line. Never an argument: argv is public."""
    if key_file is not None:
        return check_passphrase(read_private_file(key_file, "key file", Invalid), f"key file {key_file}")
    if (value := environ.get(BACKUP_PASSPHRASE_ENV)) is not None:
        return check_passphrase(value.encode(), BACKUP_PASSPHRASE_ENV)
    return check_passphrase(stdin.readline(4096), "standard input")
