"""The envelope of backups written by earlier versions of the appliance, read only (backups are
written as age files now: installer.backup_age): a header, then the archive sealed in chunks, each
encrypted and authenticated, so that a wrong passphrase, a bit flipped anywhere, a chunk dropped, moved or
appended, and a file cut short are all refused before anything is restored.

    APPLIANCE-BACKUP\\n            what the file is (anything else: not an appliance backup)
    {header}\\n                    JSON: format, when, which appliance version, the key's salt
    chunk, chunk, ...             4-byte big-endian length, then AES-256-GCM ciphertext and tag

The key comes from a passphrase (or a key file's contents) through scrypt. Chunk i is sealed with
the nonce prefix || i || last-flag and the header line as associated data: the STREAM construction
(Hoang, Reyhanitabar, Rogaway, Vizár 2015), which makes the order and the end of the stream part of
what is authenticated.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from installer.backup_archive import BackupError

MAGIC = b"APPLIANCE-BACKUP\n"
FORMAT = 1  # the last format of this envelope
CHUNK = 1 << 20
MAX_HEADER = 4096
SCRYPT = {"n": 1 << 17, "r": 8, "p": 1}  # 128 MiB and ~0.5 s a derivation: each guess costs as much


@dataclass(frozen=True)
class Header:
    """What a backup says of itself before its key is known (authenticated once it is)."""

    format: int
    created: str
    appliance_version: str
    salt: bytes
    nonce_prefix: bytes


def _key(passphrase: bytes, salt: bytes) -> AESGCM:
    return AESGCM(Scrypt(salt=salt, length=32, **SCRYPT).derive(passphrase))


def _nonce(prefix: bytes, index: int, last: bool) -> bytes:
    return prefix + struct.pack(">IB", index, last)


def read_header(source: BinaryIO, name: str) -> tuple[Header, bytes]:
    """The header of the backup `source` (named `name` in errors) and its line, as written."""
    if source.read(len(MAGIC)) != MAGIC:
        raise BackupError(f"{name} is not an appliance backup (it does not start with {MAGIC.strip().decode()})")
    line = source.readline(MAX_HEADER)
    try:
        fields: dict[str, Any] = json.loads(line)
        kdf = fields["kdf"]
        header = Header(int(fields["format"]), str(fields["created"]), str(fields["appliance_version"]),
                        bytes.fromhex(kdf["salt"]), bytes.fromhex(fields["nonce_prefix"]))
        known_kdf = kdf["name"] == "scrypt" and {k: kdf[k] for k in SCRYPT} == SCRYPT
    except (ValueError, KeyError, TypeError) as exc:
        raise BackupError(f"{name}: its header is damaged ({type(exc).__name__})") from None
    if header.format > FORMAT:
        raise BackupError(f"{name} was written by a newer appliance ({header.appliance_version}, backup format "
                          f"{header.format}); this one reads formats up to {FORMAT}", hint="restore it with that "
                          "version or newer")
    if header.format < 1 or not known_kdf or len(header.salt) != 16 or len(header.nonce_prefix) != 7:
        raise BackupError(f"{name}: its header names a format or key derivation this appliance does not know")
    return header, line


class SealedReader:
    """A read-only file object over a sealed backup: each chunk is authenticated before any of it is
    returned, and the stream must end with the chunk sealed as the last."""

    def __init__(self, source: BinaryIO, passphrase: bytes, name: str) -> None:
        self.header, self._line = read_header(source, name)
        self._aead = _key(passphrase, self.header.salt)
        self._source, self._name = source, name
        self._buffer, self._index, self._ended = b"", 0, False

    def _next_chunk(self) -> None:
        length = self._source.read(4)
        if len(length) < 4:
            raise BackupError(f"{self._name} is cut short (it ends after chunk {self._index}, before its last)")
        (size,) = struct.unpack(">I", length)
        if size > CHUNK + 16:
            raise BackupError(f"{self._name}: chunk {self._index} claims {size} bytes; the file is damaged")
        sealed = self._source.read(size)
        if len(sealed) < size:
            raise BackupError(f"{self._name} is cut short (in chunk {self._index})")
        for last in (False, True):
            try:
                plain = self._aead.decrypt(_nonce(self.header.nonce_prefix, self._index, last), sealed, self._line)
            except InvalidTag:
                continue
            self._index += 1
            self._buffer += plain
            if last:
                self._ended = True
                if self._source.read(1):
                    raise BackupError(f"{self._name} has data after its last chunk; the file was altered")
            return
        if self._index == 0:
            raise BackupError(f"{self._name}: wrong passphrase or key file (or its first chunk is damaged)")
        raise BackupError(f"{self._name}: chunk {self._index} is damaged or out of place")

    def read(self, size: int = -1) -> bytes:
        while not self._ended and (size < 0 or len(self._buffer) < size):
            self._next_chunk()
        if size < 0:
            size = len(self._buffer)
        data, self._buffer = self._buffer[:size], self._buffer[size:]
        return data

    def finish(self) -> None:
        """Reads the rest, to its authenticated end."""
        self.read()

    def close(self) -> None:
        """Nothing runs beside this reader."""
