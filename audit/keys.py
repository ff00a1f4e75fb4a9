"""The audit log's keys: an Ed25519 key pair that signs checkpoints (private key 0600, public key
exportable for auditors) and an HMAC key for hashing prompts and completions."""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from appliance.errors import StateError
from appliance.home import Home
from appliance.secrets import secret

PRIVATE_KEY = "audit-signing-key.pem"
HMAC_SECRET = "audit-hmac-key"


def signing_key(home: Home) -> Ed25519PrivateKey:
    """The checkpoint signing key, generated (mode 0600) on first use: for writers only."""
    path = home.secrets / PRIVATE_KEY
    if not path.exists():
        key = Ed25519PrivateKey.generate()
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass  # another process made it first; read theirs
        else:
            with os.fdopen(fd, "wb") as out:
                out.write(pem)
                out.flush()
                os.fsync(out.fileno())
    return _load_private(path)


def verification_key(home: Home) -> Ed25519PublicKey:
    """The public half of this host's existing signing key, to verify with. Never creates one: a
    key made now would sign nothing in the log, and verifying against it proves nothing."""
    path = home.secrets / PRIVATE_KEY
    if not path.exists():
        raise StateError(f"no audit signing key at {path}: this host has signed no checkpoint",
                         hint="verify with the auditor's copy of the public key (--public-key)")
    return _load_private(path).public_key()


def _load_private(path: Path) -> Ed25519PrivateKey:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise StateError(f"audit signing key {path} is readable by others (mode {mode:o})", hint=f"chmod 600 {path}")
    loaded = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(loaded, Ed25519PrivateKey):
        raise StateError(f"{path} is not an Ed25519 private key")
    return loaded


def public_pem(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    """The public key as PEM, for auditors."""
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def load_public(path: Path) -> Ed25519PublicKey:
    loaded = serialization.load_pem_public_key(path.read_bytes())
    if not isinstance(loaded, Ed25519PublicKey):
        raise ValueError(f"{path}: not an Ed25519 public key")
    return loaded


def key_id(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """A short name for a key: SHA-256 of its public PEM, first 16 hex digits."""
    return hashlib.sha256(public_pem(key)).hexdigest()[:16]


class TextHasher:
    """Keyed hashes of prompts and completions: equal texts compare equal, texts stay secret."""

    def __init__(self, home: Home) -> None:
        self._key = secret(home, HMAC_SECRET).encode()

    def __call__(self, text: str | None) -> str | None:
        if text is None:
            return None
        # surrogatepass: any Python string, lone surrogates included, hashes without loss.
        return hmac.new(self._key, text.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()
