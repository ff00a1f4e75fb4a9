"""Backups in the envelope earlier versions of the appliance wrote, made for the tests and the bench
that show such backups still restore (the appliance reads them, installer.backup_legacy, and no
longer writes them)."""

from __future__ import annotations

import json
import os
import struct

from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from installer import backup_legacy


def legacy_sealed(plain: bytes, passphrase: bytes) -> bytes:
    """`plain` in the envelope earlier versions wrote (their writer's construction, kept here only to
    make such a backup): header line, then AES-256-GCM chunks of 1 MiB, STREAM nonces."""
    salt, prefix = os.urandom(16), os.urandom(7)
    line = json.dumps({"format": backup_legacy.FORMAT, "created": "2026-01-01T00:00:00Z", "appliance_version": "0.1.0",
                       "kdf": {"name": "scrypt", "salt": salt.hex(), **backup_legacy.SCRYPT},
                       "nonce_prefix": prefix.hex()}, sort_keys=True).encode() + b"\n"
    aead = AESGCM(Scrypt(salt=salt, length=32, **backup_legacy.SCRYPT).derive(passphrase))
    pieces = [plain[i:i + backup_legacy.CHUNK] for i in range(0, len(plain), backup_legacy.CHUNK)] or [b""]
    out = [backup_legacy.MAGIC, line]
    for index, piece in enumerate(pieces):
        sealed = aead.encrypt(prefix + struct.pack(">IB", index, index == len(pieces) - 1), piece, line)
        out.append(struct.pack(">I", len(sealed)) + sealed)
    return b"".join(out)
