"""The appliance's own certificate authority, the certificates it issues, and whom each client trusts.

The embedded Keycloak listens only on TLS, with a certificate this CA issued for loopback. The
gateway, CLI, TUI and installer verify it against the CA, so they take Keycloak's signing keys only
from Keycloak and send the gateway's client secret or a password to no other listener: a local
process that takes Keycloak's port while it restarts cannot complete the handshake. The CA's key
stays in `secrets/` (0600); its certificate, `tls/ca.pem`, is public (`appliance tls export-ca`).

The gateway serving the network uses the same CA (or the organisation's certificate). Every
certificate the CA issues names `localhost`: the appliance's own processes reach any of its
servers by asking for that name (SNI), whatever certificate the server shows the network.
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import ipaddress
import os
import ssl
import urllib.parse
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from appliance.durable import replace_file
from appliance.errors import StateError
from appliance.home import Home
from appliance.settings import Settings

CA_KEY = "tls-ca.key"
CA_DAYS = 3650
SERVER_DAYS = 397
# A server certificate this close to its end is reissued (at the next start; the gateway's by the
# running gateway itself).
RENEW_BEFORE = datetime.timedelta(days=30)
LOOPBACK_NAME = "localhost"  # named by every certificate the CA issues; the name local clients ask for
# TLS 1.2's suites with forward secrecy and an AEAD cipher (TLS 1.3's are all of that kind).
MODERN_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"


def tls_dir(home: Home) -> Path:
    return home.root / "tls"


def ca_file(home: Home) -> Path:
    """The CA certificate clients trust for the embedded Keycloak."""
    return tls_dir(home) / "ca.pem"


def server_files(home: Home, name: str) -> tuple[Path, Path]:
    """(certificate chain, private key) of the server called `name`."""
    return tls_dir(home) / f"{name}.pem", home.secrets / f"tls-{name}.key"


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _load_key(path: Path) -> ec.EllipticCurvePrivateKey:
    if path.stat().st_mode & 0o077:
        raise StateError(f"private key {path} is readable by others", hint=f"chmod 600 {path}")
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise StateError(f"{path} is not an EC private key")
    return key


def ensure_ca(home: Home) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The CA (made once: an EC P-256 key and a self-signed certificate for ten years)."""
    cert_path, key_path = ca_file(home), home.secrets / CA_KEY
    if cert_path.exists() and key_path.exists():
        return x509.load_pem_x509_certificate(cert_path.read_bytes()), _load_key(key_path)
    if cert_path.exists() != key_path.exists():
        present = cert_path if cert_path.exists() else key_path
        raise StateError(f"{present} exists without its pair; the appliance's CA is incomplete",
                         hint=f"remove {present} to have a new CA made (clients must then trust the new ca.pem)")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "appliance local CA")])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    tls_dir(home).mkdir(mode=0o755, exist_ok=True)
    replace_file(key_path, _pem_key(key))
    replace_file(cert_path, cert.public_bytes(serialization.Encoding.PEM), mode=0o644)
    return cert, key


def _current(cert_path: Path, key_path: Path, ca: x509.Certificate, names: list[x509.GeneralName]) -> bool:
    """Whether the server certificate exists, chains to this CA, names exactly `names` and is
    not near its end."""
    if not (cert_path.exists() and key_path.exists()):
        return False
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    try:
        cert.verify_directly_issued_by(ca)  # by this CA, not merely one of the same name (a CA made anew)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return cert.not_valid_after_utc - RENEW_BEFORE > _now() and set(sans) == set(names)


def certificate_sha256(certificate: x509.Certificate) -> str:
    """SHA-256 of a certificate (DER): what a joining worker pins of its head's CA."""
    return hashlib.sha256(certificate.public_bytes(serialization.Encoding.DER)).hexdigest()


def ca_sha256(home: Home) -> str:
    """The fingerprint of this appliance's CA (`certificate_sha256`)."""
    return certificate_sha256(ensure_ca(home)[0])


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def ensure_server_certificate(home: Home, name: str, addresses: Iterable[str] = (), *,
                              renew: bool = False) -> tuple[Path, Path]:
    """A server certificate for `name` from the CA, for loopback and `addresses` (IP addresses or
    DNS names), issued again near its end, when the names change, or with `renew`. Its key is
    written before it: a reader that finds the new certificate finds its key."""
    ca, ca_key = ensure_ca(home)
    cert_path, key_path = server_files(home, name)
    names = list(dict.fromkeys([x509.DNSName(LOOPBACK_NAME), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                *(_general_name(address) for address in addresses)]))
    with _issuing(home, name):  # `appliance tls renew` and the gateway's own renewal may meet
        if not renew and _current(cert_path, key_path, ca, names):
            return cert_path, key_path
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"appliance {name}")]))
                .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=SERVER_DAYS))
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.SubjectAlternativeName(names), critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                               critical=False)
                .sign(ca_key, hashes.SHA256()))
        replace_file(key_path, _pem_key(key))
        replace_file(cert_path, cert.public_bytes(serialization.Encoding.PEM), mode=0o644)
    return cert_path, key_path


class _issuing:
    """An exclusive lock on issuing the server certificate `name`."""

    def __init__(self, home: Home, name: str) -> None:
        self.path = home.secrets / f"tls-{name}.lock"

    def __enter__(self) -> None:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *_: object) -> None:
        os.close(self.fd)


def server_context(certificate: Path, private_key: Path) -> ssl.SSLContext:
    """A server's TLS: 1.2 or later, forward secrecy and AEAD ciphers only, no compression or
    renegotiation; StateError naming the file if the pair cannot be loaded."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_ciphers(MODERN_CIPHERS)
    context.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION | ssl.OP_CIPHER_SERVER_PREFERENCE
    load_pair(context, certificate, private_key)
    return context


def load_pair(context: ssl.SSLContext, certificate: Path, private_key: Path) -> None:
    """Load a certificate chain and its key into `context` (new handshakes use them); StateError
    saying which file is wrong and how, the context unchanged."""
    if private_key.stat().st_mode & 0o077:
        raise StateError(f"private key {private_key} is readable by others", hint=f"chmod 600 {private_key}")
    try:
        context.load_cert_chain(certificate, private_key, password=_no_password)
    except (ssl.SSLError, _Encrypted) as exc:
        why = {"KEY_VALUES_MISMATCH": f"{private_key} is not the key of {certificate}"}.get(
            getattr(exc, "reason", None) or "", f"{certificate} or {private_key} is not PEM, or the key is encrypted")
        raise StateError(why, hint="the certificate file holds the PEM certificate, then its chain; the key file "
                         "its unencrypted private key") from None


class _Encrypted(Exception):
    pass


def _no_password() -> str:
    """An encrypted key's password prompt: there is no one to answer it."""
    raise _Encrypted


def organisation_certificate_problem(certificate: Path, private_key: Path) -> str | None:
    """Why the gateway cannot serve the organisation's certificate (missing, unreadable, not
    PEM, not its key's, outside its validity); None when it can."""
    for path in (certificate, private_key):
        if not path.is_file():
            return f"{path} is not a file"
    try:
        leaf = x509.load_pem_x509_certificate(certificate.read_bytes())
    except ValueError:
        return f"{certificate} does not start with a PEM certificate (-----BEGIN CERTIFICATE-----)"
    except OSError as exc:
        return f"{certificate}: {exc.strerror}"
    try:
        server_context(certificate, private_key)
    except (StateError, OSError) as exc:
        return str(exc)
    now = _now()
    if not leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc:
        return (f"{certificate} is valid from {leaf.not_valid_before_utc:%Y-%m-%d} to "
                f"{leaf.not_valid_after_utc:%Y-%m-%d} only")
    return None


def gateway_names(settings: Settings) -> list[str]:
    """What the gateway's certificate from the CA names besides loopback: a specific bind
    address, `gateway.names` and the host of `gateway.public_url`."""
    bind = settings.gateway.bind
    try:
        specific = [] if ipaddress.ip_address(bind).is_unspecified else [bind]
    except ValueError:
        specific = []  # a host name to bind is not a name the CA vouches for: gateway.names are checked
    public = urllib.parse.urlsplit(settings.gateway.public_url).hostname if settings.gateway.public_url else None
    return list(dict.fromkeys([*specific, *settings.gateway.names, *([public] if public else [])]))


def gateway_certificate(settings: Settings, home: Home, *, renew: bool = False) -> tuple[Path, Path]:
    """The pair the CA issued the gateway (issued or renewed as needed): what it shows local
    clients, and the network too unless the organisation's certificate is set."""
    return ensure_server_certificate(home, "gateway", gateway_names(settings), renew=renew)


def expires(certificate: Path) -> datetime.datetime:
    return x509.load_pem_x509_certificate(certificate.read_bytes()).not_valid_after_utc


def local_trust(home: Home) -> ssl.SSLContext:
    """What the appliance's own processes verify its servers with: the CA, hostname `localhost`."""
    path = ca_file(home)
    if not path.is_file():
        raise StateError(f"the appliance's CA {path} does not exist yet",
                         hint="`appliance up` makes it when it first starts")
    return ssl.create_default_context(cafile=path)


def keycloak_trust(settings: Settings, home: Home) -> str | bool:
    """What verifies Keycloak's certificate (python-keycloak's and requests' `verify`): the
    appliance's CA for the embedded one; the configured CA file, else the system's, for an external one."""
    keycloak = settings.keycloak
    if keycloak.mode == "external":
        if keycloak.ca_file and not Path(keycloak.ca_file).is_file():
            raise StateError(f"keycloak.ca_file: {keycloak.ca_file} is not a file")
        return keycloak.ca_file or True
    path = ca_file(home)
    if not path.is_file():
        raise StateError(f"the appliance's CA {path} does not exist yet",
                         hint="`appliance up` makes it when it first starts Keycloak")
    return str(path)


def keycloak_ssl(settings: Settings, home: Home) -> ssl.SSLContext:
    """An SSL context (httpx's `verify`) that trusts only what `keycloak_trust` names."""
    trust = keycloak_trust(settings, home)
    return ssl.create_default_context(cafile=trust) if isinstance(trust, str) else ssl.create_default_context()
